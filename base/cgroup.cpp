// Walking the cgroups this process is in, and their CPU limit.
#include "base/cgroup.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace strata {

bool ReadFirstLine(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f || !std::getline(f, *out)) return false;
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ' || out->back() == '\r')) out->pop_back();
  return true;
}

std::string ProcSelfCgroup() {
  std::ifstream cg("/proc/self/cgroup");
  std::stringstream text;
  text << cg.rdbuf();
  return text.str();
}

void ForEachCgroupDir(std::string_view proc_self_cgroup, const std::string& fs_root, const std::string& v1_controller,
                      const std::function<void(const std::string& dir, bool v2)>& visit) {
  // Every directory from `base + path` up to `base`.
  auto walk = [&](const std::string& base, std::string path, bool v2) {
    while (!path.empty() && path.back() == '/') path.pop_back();
    for (;;) {
      const std::string dir = base + path;
      struct stat st {};
      if (::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) visit(dir, v2);
      if (path.empty()) break;
      path.resize(path.rfind('/'));
    }
  };
  std::istringstream lines{std::string(proc_self_cgroup)};
  for (std::string line; std::getline(lines, line);) {
    // "hierarchy-id:controllers:path"; v2's is "0::path".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (path.empty() || path[0] != '/') continue;
    if (id == "0" && controllers.empty()) {
      // Unified: mounted at the root (v2 alone) or at unified/ (hybrid).
      struct stat st {};
      const bool alone = ::stat((fs_root + "/cgroup.controllers").c_str(), &st) == 0;
      walk(alone ? fs_root : fs_root + "/unified", path, true);
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name != v1_controller) continue;
      // Co-mounted controllers ("cpu,cpuacct") are mounted under the list's
      // name; a link by the controller's own name (cpu -> cpu,cpuacct) is
      // usual but not everywhere.
      struct stat st {};
      const std::string listed = fs_root + "/" + controllers;
      const bool comounted = controllers != v1_controller && ::stat(listed.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
      walk(comounted ? listed : fs_root + "/" + v1_controller, path, false);
    }
  }
}

namespace {

// A non-negative integer, or -1 where the text is not one.
long long Number(const std::string& text) {
  if (text.empty()) return -1;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || v < 0) return -1;
  return v;
}

}  // namespace

double CgroupCpuLimit(std::string_view proc_self_cgroup, const std::string& fs_root, std::string* dir) {
  double best = 0;
  ForEachCgroupDir(proc_self_cgroup, fs_root, "cpu", [&](const std::string& d, bool v2) {
    long long quota = -1, period = -1;
    std::string text;
    if (v2) {
      if (!ReadFirstLine(d + "/cpu.max", &text)) return;
      const size_t sp = text.find(' ');
      if (sp == std::string::npos) return;
      quota = Number(text.substr(0, sp));  // "max": -1, no limit
      period = Number(text.substr(sp + 1));
    } else {
      if (ReadFirstLine(d + "/cpu.cfs_quota_us", &text)) quota = Number(text);  // -1: no limit
      if (ReadFirstLine(d + "/cpu.cfs_period_us", &text)) period = Number(text);
    }
    if (quota <= 0 || period <= 0) return;
    const double cpus = static_cast<double>(quota) / static_cast<double>(period);
    if (best == 0 || cpus < best) {
      best = cpus;
      if (dir) *dir = d;
    }
  });
  return best;
}

}  // namespace strata

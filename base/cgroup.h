// The cgroups this process is in: every directory from its own cgroup up to
// the hierarchy's root, on cgroup v2 (the unified hierarchy, mounted at the
// root or, hybrid, at unified/) and on v1 (the hierarchy of one controller,
// mounted at <root>/<controller>). A directory that does not exist is
// skipped (a container sees its own cgroup at the mount's root).
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace strata {

// Calls visit(dir, v2) for each such directory: those of the unified
// hierarchy (v2 true) and those of the v1 hierarchy carrying `v1_controller`
// ("memory", "cpu"). `proc_self_cgroup` is /proc/self/cgroup's text and
// `fs_root` where the hierarchies are mounted (/sys/fs/cgroup).
void ForEachCgroupDir(std::string_view proc_self_cgroup, const std::string& fs_root, const std::string& v1_controller,
                      const std::function<void(const std::string& dir, bool v2)>& visit);

// /proc/self/cgroup's text ("" where it cannot be read).
std::string ProcSelfCgroup();

// The first line of a small file, trailing blanks trimmed; false when it
// cannot be read.
bool ReadFirstLine(const std::string& path, std::string* out);

// The tightest CPU limit of those cgroups, in CPUs (quota over period: v2's
// cpu.max "quota period", "max" unlimited; v1's cpu.cfs_quota_us over
// cpu.cfs_period_us, -1 unlimited). 0: no limit; else *dir (may be null) is
// the directory that sets it.
double CgroupCpuLimit(std::string_view proc_self_cgroup, const std::string& fs_root, std::string* dir);

}  // namespace strata

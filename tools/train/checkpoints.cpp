// strata-train's checkpoint retention.
#include "tools/train/checkpoints.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <system_error>

namespace strata::train {

namespace {

bool IsStepTag(const std::string& name) {
  return name.size() == 12 && name.compare(0, 4, "step") == 0 &&
         std::all_of(name.begin() + 4, name.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

}  // namespace

bool PruneCheckpoints(const std::string& dir, int keep, std::vector<std::string>* removed, std::string* error) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> tags;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (IsStepTag(it->path().filename().string()) && it->is_directory()) tags.push_back(it->path().filename().string());
  if (ec) {
    *error = "--keep-last: cannot list " + dir + ": " + ec.message();
    return false;
  }
  std::string latest;
  if (std::ifstream f(dir + "/latest"); f) std::getline(f, latest);
  std::sort(tags.begin(), tags.end());  // stepNNNNNNNN: by step
  for (size_t i = 0; i + static_cast<size_t>(keep) < tags.size(); ++i) {
    if (tags[i] == latest) continue;
    fs::remove_all(dir + "/" + tags[i], ec);
    if (ec) {
      *error = "--keep-last: cannot remove " + dir + "/" + tags[i] + ": " + ec.message();
      return false;
    }
    removed->push_back(tags[i]);
  }
  return true;
}

}  // namespace strata::train

// Test helpers: a temporary directory removed at the end, and an
// offset-stamped byte pattern that shows where misplaced data came from.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace strata::testing {

class TempDir {
 public:
  // Under $STRATA_TEST_DIR, else `base` (default /tmp: a real disk here).
  explicit TempDir(const std::string& base = "") {
    const char* env = std::getenv("STRATA_TEST_DIR");
    std::string root = !base.empty() ? base : (env ? env : "/var/tmp");
    std::string tmpl = root + "/strata-test-XXXXXX";
    char* p = ::mkdtemp(tmpl.data());
    path_ = p ? p : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

// Byte i of the pattern for stream offset `off`: depends on the offset and seed.
inline uint8_t PatternByte(uint64_t off, uint64_t seed) {
  uint64_t x = (off / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> ((off % 8) * 8));
}
inline void FillPattern(void* buf, uint64_t len, uint64_t base_off, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(buf);
  for (uint64_t i = 0; i < len; ++i) b[i] = PatternByte(base_off + i, seed);
}
// Returns the first mismatching index, or -1.
inline int64_t CheckPattern(const void* buf, uint64_t len, uint64_t base_off, uint64_t seed) {
  auto* b = static_cast<const uint8_t*>(buf);
  for (uint64_t i = 0; i < len; ++i)
    if (b[i] != PatternByte(base_off + i, seed)) return static_cast<int64_t>(i);
  return -1;
}

struct AlignedFree { void operator()(void* p) const { std::free(p); } };
inline void* AlignedAlloc(uint64_t len, uint64_t align = 4096) {
  void* p = nullptr;
  if (posix_memalign(&p, align, len ? len : align) != 0) return nullptr;
  return p;
}

// Writes `text` and a newline to `file`, making its folders (made-up /proc
// and /sys trees).
inline void WriteLine(const std::filesystem::path& file, const std::string& text) {
  std::filesystem::create_directories(file.parent_path());
  std::ofstream(file) << text << "\n";
}

}  // namespace strata::testing

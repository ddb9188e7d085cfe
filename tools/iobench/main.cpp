// strata-iobench: sequential and random reads and writes through Strata's
// io_uring storage, from huge-page host buffers, reported the way fio does.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "base/align.h"
#include "base/sizes.h"
#include "io/direct_file.h"
#include "io/file_storage.h"
#include "tiers/host_tier.h"

namespace strata {
namespace {

struct Args {
  std::string dir;
  std::string file_size = "4GiB", block_size = "1MiB";
  uint32_t queue_depth = 32;
  int rings = 1;
  std::string backend = "io_uring";
  std::string modes = "write,read";
  int loops = 1;
  bool buffered = false, keep = false;
  bool reuse = false;  // --reuse: a kept file of the full size is not laid out again
};

struct Bench {
  FileStorage* storage;
  FileId file;
  uint64_t file_size, block;
  std::vector<char*> bufs;
};

// One pass over the file; returns seconds.
Result<double> Pass(Bench& b, IoOp::Kind kind, bool random, uint64_t seed) {
  const uint64_t n = b.file_size / b.block;
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (random) std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  std::vector<IoOp> ops(n);
  for (uint64_t i = 0; i < n; ++i)
    ops[i] = IoOp{kind, b.file, order[i] * b.block, b.bufs[i % b.bufs.size()], b.block};
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(b.storage->Run(ops));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Report(const char* label, uint64_t bytes, uint64_t block, double secs) {
  const double mbs = static_cast<double>(bytes) / secs / 1e6;
  const double mibs = static_cast<double>(bytes) / secs / static_cast<double>(kMiB);
  std::printf("  %-9s: bw=%.0fMiB/s (%.0fMB/s), iops=%.0f, io=%s, run=%.0fmsec\n", label, mibs, mbs,
              static_cast<double>(bytes / block) / secs, FormatBytes(bytes).c_str(), secs * 1e3);
}

int Run(const Args& a) {
  auto fs = ParseByteSize(a.file_size);
  auto bs = ParseByteSize(a.block_size);
  if (!fs.ok() || !bs.ok()) {
    std::fprintf(stderr, "strata-iobench: %s\n", (!fs.ok() ? fs : bs).status().ToString().c_str());
    return 2;
  }
  // Whole blocks (a block size need not be a power of two: any multiple of 4 KiB).
  const uint64_t block = *bs, file_size = block ? *fs / block * block : 0;
  if (file_size == 0) {
    std::fprintf(stderr, "strata-iobench: --file-size must hold at least one block\n");
    return 2;
  }
  // The modes before any file is written (the layout pass writes all of it).
  std::vector<std::string> modes;
  for (std::string rest = a.modes + ","; !rest.empty();) {
    const size_t p = rest.find(',');
    const std::string m = rest.substr(0, p);
    rest.erase(0, p + 1);
    const std::string base = m.rfind("rand", 0) == 0 ? m.substr(4) : m;
    if (base != "read" && base != "write") {
      std::fprintf(stderr, "strata-iobench: --modes: '%s' is not read, write, randread or randwrite\n", m.c_str());
      return 2;
    }
    modes.push_back(m);
  }
  StorageOptions uo;
  uo.rings = a.rings;
  uo.backend = a.backend == "threads" ? IoBackend::kThreads : a.backend == "auto" ? IoBackend::kAuto : IoBackend::kUring;
  uo.queue_depth = a.queue_depth;
  uo.block_size = block;
  uo.direct = !a.buffered;
  auto storage = FileStorage::Create(uo);
  if (!storage.ok()) {
    std::fprintf(stderr, "strata-iobench: %s\n", storage.status().ToString().c_str());
    return 1;
  }
  const std::string path = a.dir + "/strata-iobench.bin";
  // A file this tool laid out and kept (--keep) holds data to its full size.
  std::error_code ec;
  const bool laid_out = a.reuse && std::filesystem::file_size(path, ec) >= file_size && !ec;
  auto file = (*storage)->Open(path, OpenMode::kCreate);
  if (!file.ok()) {
    std::fprintf(stderr, "strata-iobench: %s\n", file.status().ToString().c_str());
    return 1;
  }
  // The test file goes on every way out (unless --keep), a failed one's too.
  struct RemoveFile {
    const std::string& path;
    bool keep;
    ~RemoveFile() {
      if (!keep) std::remove(path.c_str());
    }
  } remove_file{path, a.keep};
  const FileInfo& info = (*storage)->Info(*file);
  Status st = ReserveFileSpace(info.fd, path, file_size);
  const uint64_t nbufs = static_cast<uint64_t>(a.queue_depth) * static_cast<uint64_t>(a.rings);
  HostTier host({.budget = nbufs * block + kHugePage, .storage = storage->get()});
  auto mem = host.Allocate(nbufs * block);
  if (!st.ok() || !mem.ok()) {
    std::fprintf(stderr, "strata-iobench: %s\n", (!st.ok() ? st : mem.status()).ToString().c_str());
    return 1;
  }
  std::memset(mem->ptr, 0x5A, nbufs * block);
  Bench b{storage->get(), *file, file_size, block, {}};
  for (uint64_t i = 0; i < nbufs; ++i) b.bufs.push_back(static_cast<char*>(mem->ptr) + i * block);
  std::printf("strata-iobench: %s, file %s, block %s, depth %u, %s workers %d, %s\n", path.c_str(),
              FormatBytes(file_size).c_str(), FormatBytes(block).c_str(), a.queue_depth,
              IoBackendName((*storage)->backend()), a.rings, info.direct ? "O_DIRECT" : "buffered");
  // Lay the file out once so that timed writes overwrite, as fio's do; with
  // --reuse, a kept file already laid out is not (its peer's passes do not
  // follow a whole write of the file either).
  if (!laid_out) {
    if (a.reuse) std::printf("strata-iobench: --reuse: no laid-out file of that size; laying it out\n");
    auto layout = Pass(b, IoOp::kWrite, false, 0);
    if (!layout.ok()) {
      std::fprintf(stderr, "strata-iobench: %s\n", layout.status().ToString().c_str());
      return 1;
    }
  }
  for (const std::string& m : modes) {
    const bool random = m.rfind("rand", 0) == 0;
    const std::string base = random ? m.substr(4) : m;
    for (int l = 0; l < a.loops; ++l) {
      auto secs = Pass(b, base == "read" ? IoOp::kRead : IoOp::kWrite, random, static_cast<uint64_t>(l) + 1);
      if (!secs.ok()) {
        std::fprintf(stderr, "strata-iobench: %s\n", secs.status().ToString().c_str());
        return 1;
      }
      Report(m.c_str(), file_size, block, *secs);
    }
  }
  host.Free(*mem);
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::Args a;
  CLI::App app{"strata-iobench: read and write through Strata's io_uring storage"};
  app.add_option("--dir", a.dir, "directory for the test file")->required()->check(CLI::ExistingDirectory);
  app.add_option("--file-size", a.file_size, "test file size (e.g. 4GiB)")->capture_default_str();
  app.add_option("--block-size", a.block_size, "request size (e.g. 1MiB)")->capture_default_str();
  app.add_option("--queue-depth", a.queue_depth, "requests in flight per ring")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--rings", a.rings, "workers: io_uring rings, or thread pools")->capture_default_str()->check(CLI::Range(1, 64));
  app.add_option("--backend", a.backend, "io_uring, threads (pread and pwrite), or auto (io_uring where allowed)")
      ->capture_default_str()
      ->check(CLI::IsMember({"io_uring", "threads", "auto"}));
  app.add_option("--modes", a.modes, "comma-separated: write, read, randwrite, randread")->capture_default_str();
  app.add_option("--loops", a.loops, "passes per mode")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_flag("--buffered", a.buffered, "buffered I/O instead of O_DIRECT");
  app.add_flag("--keep", a.keep, "keep the test file");
  app.add_flag("--reuse", a.reuse, "a kept test file of the full size is used as it is, not laid out again");
  CLI11_PARSE(app, argc, argv);
  return strata::Run(a);
}

// libFuzzer target: the checkpoint manifest reader (engine/manifest). Any
// input must parse to a manifest whose fields are in range, or be refused
// with CORRUPT; never crash, hang or touch memory it should not. What
// parses must survive Seal and parse again to the same layout.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "base/dtype.h"
#include "engine/format/manifest.h"

using namespace strata;

static void Require(bool ok) {
  if (!ok) std::abort();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto m = manifest::Parse(text, "fuzz/manifest.json");
  if (!m.ok()) {
    Require(m.status().code() == Code::kCorrupt);
    return 0;
  }
  // The promises the load relies on.
  Require(m->loss_scale > 0 && m->step >= 0 && !m->groups.empty());
  Require(m->files.size() == static_cast<size_t>(m->shard_world));
  for (size_t k = 0; k < m->files.size(); ++k) {
    const manifest::File& f = m->files[k];
    Require(f.rank == static_cast<int>(k));
    for (const manifest::Block& b : f.blocks) {
      Require(b.group < m->groups.size() && b.state >= 0 && b.state < manifest::kNumBlockStates);
      Require((b.state == manifest::kSavedP) == m->groups[b.group].frozen);  // P: a frozen group's only block
      Require(b.offset <= f.bytes && b.bytes <= f.bytes - b.offset);
      const uint64_t n = m->groups[b.group].shard_numel;
      if (b.state == manifest::kSavedP) {
        auto dt = ParseDType(m->compute_dtype);
        Require(dt.ok() && b.bytes == n * DTypeSize(*dt));
      } else {
        Require(b.bytes == manifest::SavedBlockBytes(m->state_format == "compact", b.state, n));
      }
    }
  }
  for (const manifest::Group& g : m->groups)
    Require(g.shard_numel * static_cast<uint64_t>(m->shard_world) == g.padded && g.padded >= g.numel);
  // Sealed again, it parses again, sealed, to the same layout.
  auto again = manifest::Parse(manifest::Seal(text), "fuzz/sealed.json");
  Require(again.ok() && again->sealed && again->step == m->step && again->files.size() == m->files.size());
  return 0;
}

// PHome: the PSource of a built engine — P's home blocks (host, NVMe, or the
// device tier) read into a device copy, through a parameter staging slot
// when the copy is on a GPU and P is not in host memory.
// Touches only what it is given: the layout (read), the blocks' I/O, the
// device tier's copies, the staging pool and the stats. No lock of its own:
// loads of different groups may run at once (the pool and the tiers lock).
#pragma once

#include "engine/layout/layout.h"
#include "engine/layout/staging.h"
#include "engine/residency/residency.h"

namespace strata {

class PHome final : public PSource {
 public:
  // `blocks(g)`: group g's P block (its home).
  PHome(const Layout& layout, std::function<const StateBlock&(int)> blocks, BlockIo& io, DeviceTier& device,
        StagingPool& staging, StatsRecorder& stats)
      : layout_(layout), blocks_(std::move(blocks)), io_(io), device_(device), staging_(staging), stats_(stats) {}
  Status Load(int g, void* copy) override;

 private:
  const Layout& layout_;
  const std::function<const StateBlock&(int)> blocks_;
  BlockIo& io_;
  DeviceTier& device_;
  StagingPool& staging_;
  StatsRecorder& stats_;
};

}  // namespace strata

// The activation store in the step's simulation (activation_sim.h).
#include "tools/plan/activation_sim.h"

#include <algorithm>
#include <iterator>

namespace strata::plan {

ActivationSim::ActivationSim(const Config& cfg, const ModelSpec& m, Io io) : m_(m), io_(std::move(io)) {
  // An arena less the room kept for the NVMe stashes' way through it, the
  // swap beyond it, the read-ahead window.
  const uint64_t host = cfg.strata.activation_host_bytes;
  if (host == 0 || m.hidden == 0) return;
  window_ = static_cast<double>(cfg.strata.activation_prefetch_bytes);
  nvme_ = static_cast<double>(cfg.strata.activation_nvme_bytes);
  arena_ = static_cast<double>(host) - (nvme_ > 0 ? std::min(window_, host / 2.0) : 0.0);
  on_ = true;
}

std::vector<double> ActivationSim::StashBytes(const std::vector<GroupUse>& uses) const {
  std::vector<double> out(uses.size(), 0);
  if (!on_) return out;
  double flops = 0;
  for (const GroupUse& u : uses)
    if (!u.grads && !u.head) flops += u.flops;
  const double total = std::min(static_cast<double>(StashableActivationBytes(m_)), arena_ + nvme_);
  if (flops <= 0) return out;
  for (size_t k = 0; k < uses.size(); ++k)
    if (!uses[k].grads && !uses[k].head) out[k] = total * uses[k].flops / flops;
  return out;
}

void ActivationSim::BeginMicroBatch() {
  stashes_.clear();
  in_arena_ = 0;
}

void ActivationSim::Stash(int g, double t, double bytes, SimResult* r) {
  r->act_bytes += static_cast<uint64_t>(bytes);
  stashes_.push_back({g, bytes, false, io_.copy(t, bytes), 0, false});
  in_arena_ += bytes;
  for (Stashed& s : stashes_) {
    if (in_arena_ <= arena_) break;
    if (s.on_nvme || s.group == g) continue;
    s.on_nvme = true;
    in_arena_ -= s.bytes;
    r->act_nvme_bytes += static_cast<uint64_t>(s.bytes);
    io_.spill(s.ready, s.bytes);
  }
}

double ActivationSim::Redeem(int g, double t, SimResult* r) {
  auto it = std::find_if(stashes_.rbegin(), stashes_.rend(), [&](const Stashed& s) { return s.group == g; });
  if (it == stashes_.rend()) return t;
  Stashed& s = *it;
  double ready = std::max(t, s.ready);
  if (s.on_nvme) ready = s.read ? std::max(t, s.read_done) : io_.read_back(ready, s.bytes);
  double ahead = 0;
  for (auto jt = std::next(it); jt != stashes_.rend() && ahead < window_; ++jt) {
    if (!jt->on_nvme) continue;
    ahead += jt->bytes;
    if (!jt->read) {
      jt->read = true;
      jt->read_done = io_.read_back(t, jt->bytes);
    }
  }
  if (ready > t) {  // waited for the disk (the copy back is the redeem's own work)
    ++r->act_stalls;
    r->act_stall_s += ready - t;
  }
  const double back = io_.copy(ready, s.bytes);
  stashes_.erase(std::next(it).base());
  return std::max(t, back);
}

}  // namespace strata::plan

// Engine: the ranks as a trainer sees them — which one this process is, and
// sums of the trainer's own figures (its loss, its token counts) over all of
// them, so that a data-parallel trainer logs the global figure, not rank 0's.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/engine_impl.h"

namespace strata {

int Engine::rank() const { return impl_->options_.rank; }
int Engine::world_size() const { return impl_->options_.world_size; }

// An all-gather of every rank's values, summed in rank order on every rank:
// the same bits everywhere (an fp32 all-reduce's order is the backend's, and
// a trainer's loss wants fp64). Runs on the caller's thread, as every other
// collective of the engine, so program order is the same on every rank.
Status Engine::SumOverRanks(double* values, size_t n) {
  Impl& m = *impl_;
  if (values == nullptr && n > 0)
    return InvalidError("sum_over_ranks: values is null with n " + std::to_string(n));
  STRATA_RETURN_IF_ERROR(m.DrainComm().WithContext("sum_over_ranks"));
  STRATA_RETURN_IF_ERROR(m.CheckUsable("sum_over_ranks", /*pending_ok=*/false, /*in_pass=*/true));
  // Mid-step, the overlapped step's thread may be running collectives of its own.
  for (int g = 0; g < m.lay_.part.num_groups() && m.built_; ++g)
    if (m.steps_[static_cast<size_t>(g)].grad_calls > 0 || m.steps_[static_cast<size_t>(g)].parts.open)
      return StateError("sum_over_ranks: gradients of group " + std::to_string(g) +
                        " are pending; call it before the step's first grads or after its step");
  if (!m.lay_.multi || n == 0) return Status::Ok();
  const size_t w = static_cast<size_t>(m.comm_->world_size()), r = static_cast<size_t>(m.comm_->rank());
  if (n > SIZE_MAX / sizeof(double) / w)
    return InvalidError("sum_over_ranks: n " + std::to_string(n) + " values times " + std::to_string(w) +
                        " ranks overflows the size of memory");
  std::vector<double> all(n * w);
  std::memcpy(all.data() + r * n, values, n * sizeof(double));
  m.comm_->SetLabel("sum_over_ranks");
  STRATA_RETURN_IF_ERROR(
      m.comm_->AllGather(all.data() + r * n, all.data(), n * sizeof(double)).WithContext("sum_over_ranks"));
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (size_t k = 0; k < w; ++k) sum += all[k * n + i];
    values[i] = sum;
  }
  return Status::Ok();
}

}  // namespace strata

// AgreeOverRanks (agree.h).
#include "engine/reduce/agree.h"

#include <vector>

namespace strata {

Status AgreeOverRanks(net::Communicator* comm, const Status& local, const std::string& what,
                      std::vector<int>* failed) {
  if (!comm || comm->world_size() <= 1) {
    if (failed) *failed = local.ok() ? std::vector<int>{} : std::vector<int>{0};
    return local;
  }
  const int w = comm->world_size(), r = comm->rank();
  std::vector<int32_t> codes(static_cast<size_t>(w));
  codes[static_cast<size_t>(r)] = local.ok() ? 0 : 1 + static_cast<int32_t>(local.code());
  comm->SetLabel(what);
  Status st = comm->AllGather(&codes[static_cast<size_t>(r)], codes.data(), sizeof(int32_t));
  // The agreement's own failure keeps its code (COMM, TIMEOUT: a load's
  // NOT_FOUND here must not read as "start fresh" while the ranks could
  // not agree), with this rank's own cause in the message.
  if (!st.ok() && !local.ok())
    return Status(st.code(), what + ": " + st.message() + " (this rank had failed before it: " + local.ToString() + ")");
  if (!st.ok()) return st.WithContext(what);
  if (failed) {
    failed->clear();
    for (int k = 0; k < w; ++k)
      if (codes[static_cast<size_t>(k)]) failed->push_back(k);
  }
  if (!local.ok()) return local;
  for (int k = 0; k < w; ++k)
    if (codes[static_cast<size_t>(k)])
      return Status(static_cast<Code>(codes[static_cast<size_t>(k)] - 1),
                    what + ": failed on rank " + std::to_string(k) + " (see its log)");
  return Status::Ok();
}

}  // namespace strata

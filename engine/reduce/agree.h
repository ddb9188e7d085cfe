// AgreeOverRanks: every rank learns whether every rank succeeded at
// something each did alone (a check, a write), so that none goes on while
// another has refused. A failure elsewhere names its rank.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "io/net/comm.h"

namespace strata {

// `comm` null or of one rank: `local` as it is. Else one all-gather of the
// ranks' outcomes (labelled `what`): `local` when it failed, else the first
// other rank's failure (its code, "WHAT: failed on rank K (see its log)").
// `failed` (optional): every rank whose outcome was a failure, in order
// (left as it was when the all-gather itself fails).
Status AgreeOverRanks(net::Communicator* comm, const Status& local, const std::string& what,
                      std::vector<int>* failed = nullptr);

}  // namespace strata

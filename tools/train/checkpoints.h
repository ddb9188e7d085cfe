// strata-train's checkpoint retention (--keep-last): the folder's own tags
// (stepNNNNNNNN), the oldest removed beyond the newest N.
#pragma once

#include <string>
#include <vector>

namespace strata::train {

// Removes DIR's strata-train checkpoints (tags stepNNNNNNNN) older than the
// newest `keep`, never the one DIR/latest names; `removed` lists the tags
// removed. false with `error` (naming the path) when DIR cannot be listed
// or a checkpoint cannot be removed (those before it are gone).
bool PruneCheckpoints(const std::string& dir, int keep, std::vector<std::string>* removed, std::string* error);

}  // namespace strata::train

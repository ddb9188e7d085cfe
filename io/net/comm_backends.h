// Constructors of the communicator backends (internal to io/net); each lives
// in its own file: comm_self.cpp, comm_gloo.cpp, comm_nccl.cpp.
#pragma once

#include <memory>

#include "io/net/comm.h"

namespace strata::net {

std::unique_ptr<Communicator> MakeSelfComm();
// Rendezvous through options.store (or a private store for one rank), then a
// barrier. Defined only when the build has Gloo / NCCL.
Result<std::unique_ptr<Communicator>> MakeGlooComm(const CommOptions& options);
Result<std::unique_ptr<Communicator>> MakeNcclComm(const CommOptions& options);
bool NcclGpuPresent();

}  // namespace strata::net

// Where a Gloo rank listens, and how the ranks tell hosts apart (comm_gloo.cpp's
// rendezvous): the listen address (an interface named by a variable, else
// the route to the master), this host's key, and the check that no rank
// listens on a loopback address while a rank runs on another host.
#pragma once

#include <string>

#include "base/status.h"
#include "io/net/comm.h"
#include "io/net/launch_env.h"
#include "io/net/store.h"  // Millis

namespace strata::net {

// The local address this host uses to reach `master`.
Result<std::string> RouteAddress(const std::string& master, int port);
// The IPv4 address of interface `ifname`, named by variable `var`.
Result<std::string> InterfaceAddress(const char* var, std::string ifname);
// Where Gloo listens, and why (`*why`).
Result<std::string> ListenAddress(const RankInfo& r, std::string* why);
// This host: the kernel's boot id and the network namespace.
std::string HostKey();
// Whether `addr` is an IPv4 loopback address (127/8).
bool IsLoopbackAddress(const std::string& addr);
// Every rank says its host and listen address in the store; a rank on a
// loopback address beside a rank on another host is refused (INVALID).
Status CheckReachable(const CommOptions& o, const std::string& local, const std::string& why, Millis timeout);

}  // namespace strata::net

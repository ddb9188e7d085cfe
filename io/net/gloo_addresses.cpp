// Where a Gloo rank listens, and how the ranks tell hosts apart (gloo_addresses.h).
#include "io/net/gloo_addresses.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "io/net/store.h"

namespace strata::net {

// The local address this host uses to reach `master` (a UDP connect sends
// nothing; the kernel just picks the route).
Result<std::string> RouteAddress(const std::string& master, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  int rc = getaddrinfo(master.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) return CommError("gloo: cannot resolve MASTER_ADDR '" + master + "': " + gai_strerror(rc));
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  int err = errno;
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  if (!ok) return PosixError("gloo: find the local address routing to", master, err);
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf);
  return std::string(buf);
}

// The IPv4 address of interface `ifname`, named by variable `var`; kInvalid
// listing this host's interfaces when it has none. A comma-separated list
// (torch's GLOO_SOCKET_IFNAME may hold one) uses its first name.
Result<std::string> InterfaceAddress(const char* var, std::string ifname) {
  if (auto comma = ifname.find(','); comma != std::string::npos) ifname.resize(comma);
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return PosixError(std::string("gloo: list the interfaces for ") + var, ifname, errno);
  std::string found, have;
  for (ifaddrs* a = all; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
    if (found.empty() && ifname == a->ifa_name) found = buf;
    have += (have.empty() ? "" : ", ") + std::string(a->ifa_name) + " " + buf;
  }
  freeifaddrs(all);
  if (found.empty())
    return InvalidError(std::string(var) + "=" + ifname + ": this host has no interface of that name with an IPv4 " +
                        "address (it has: " + (have.empty() ? "none" : have) + ")");
  return found;
}

// Where Gloo listens, and why: STRATA_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME
// (an interface's address), else the address that routes to the master.
Result<std::string> ListenAddress(const RankInfo& r, std::string* why) {
  for (const char* var : {"STRATA_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* v = std::getenv(var);
    if (v && *v) {
      *why = std::string(var) + "=" + v;
      return InterfaceAddress(var, v);
    }
  }
  *why = "the route to MASTER_ADDR " + r.master_addr;
  return RouteAddress(r.master_addr, r.master_port);
}

// This host as the ranks tell hosts apart: the kernel's boot id and the
// network namespace (ranks in other network namespaces are other hosts, as
// the tests' emulated hosts are, even where they could share /dev/shm: their
// traffic must take the network).
std::string HostKey() {
  std::string key;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char b[64] = {};
    if (std::fgets(b, sizeof b, f)) key = b;
    std::fclose(f);
  }
  while (!key.empty() && (key.back() == '\n' || key.back() == ' ')) key.pop_back();
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  return key + "/" + (n > 0 ? std::string(ns, static_cast<size_t>(n)) : "");
}

bool IsLoopbackAddress(const std::string& addr) {
  in_addr a{};
  return inet_pton(AF_INET, addr.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

// Every rank said its host and the address it listens on: one that listens
// on a loopback address while a rank runs on another host can never be
// reached (the full mesh waited for it until strata.timeout, then failed
// naming a connection). The common cause: MASTER_ADDR is this host's name,
// which Debian's /etc/hosts maps to 127.0.1.1, so the route to it is the
// loopback. Refused at once, on every rank, naming the address and the way
// out.
Status CheckReachable(const CommOptions& o, const std::string& local, const std::string& why, Millis timeout) {
  const RankInfo& r = o.rank;
  std::vector<std::string> hosts(static_cast<size_t>(r.world_size)), addrs(hosts.size());
  for (int k = 0; k < r.world_size; ++k) {
    auto v = o.store->Get(o.prefix + "/host/" + std::to_string(k), timeout);
    if (!v.ok()) return v.status();
    const std::string said(v->begin(), v->end());
    const size_t nl = said.find('\n');
    hosts[static_cast<size_t>(k)] = said.substr(0, nl);
    addrs[static_cast<size_t>(k)] = nl == std::string::npos ? "" : said.substr(nl + 1);
  }
  // Rank 0 serves the store: it refuses only once every rank has read what
  // it needs to refuse too (else they would see the store gone, not why).
  const std::string seen = "1";
  STRATA_RETURN_IF_ERROR(o.store->Set(o.prefix + "/host_seen/" + std::to_string(r.rank), Bytes(seen.begin(), seen.end())));
  auto refuse = [&](Status st) {
    for (int k = 0; r.rank == 0 && k < r.world_size; ++k) (void)o.store->Get(o.prefix + "/host_seen/" + std::to_string(k), timeout);
    return st;
  };
  for (int k = 0; k < r.world_size; ++k) {
    if (!IsLoopbackAddress(addrs[static_cast<size_t>(k)])) continue;
    for (int j = 0; j < r.world_size; ++j) {
      if (hosts[static_cast<size_t>(j)] == hosts[static_cast<size_t>(k)]) continue;
      return refuse(InvalidError(
          "rank " + std::to_string(k) + " listens on " + addrs[static_cast<size_t>(k)] +
          ", a loopback address, but rank " + std::to_string(j) + " runs on another host and cannot reach it" +
          (k == r.rank ? " (this rank's address: " + why + ", " + local + ")" : "") +
          ". MASTER_ADDR '" + r.master_addr + "' may resolve to a loopback address on rank " + std::to_string(k) +
          "'s host (Debian's /etc/hosts maps the host's name to 127.0.1.1): give MASTER_ADDR as an address the "
          "other hosts reach, or STRATA_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) naming the interface to listen on"));
    }
  }
  return Status::Ok();
}

}  // namespace strata::net

// FreeListenPort: a TCP port nobody listens on now, chosen outside the
// kernel's ephemeral range. A port from bind(0) lies in that range, from
// which the kernel also gives every outgoing connection its local port, so
// by the time it is listened on some connection may hold it; below or above
// the range only another listener can take it first (good enough on one
// machine). Header-only: strata-launch uses it without Strata's libraries.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <random>

namespace strata::net {

// Whether a listener could bind `port` on every interface now.
inline bool PortBinds(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

// A free port in [20000, the range's start - 2] or [its end + 1, 65534]
// (whichever hold any), with the one above it free too where `pair` (a rank
// that runs torch.distributed leaves MASTER_PORT to torch's store and
// Strata's takes MASTER_PORT + 1). -1 with errno EADDRINUSE when 200 tries
// found none.
inline int FreeListenPort(bool pair) {
  int lo = 32768, hi = 60999;
  if (std::FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768, hi = 60999;
    std::fclose(f);
  }
  const int spans[2][2] = {{20000, lo - 2}, {hi + 1, 65534}};
  std::mt19937 gen(std::random_device{}());
  for (int tries = 0; tries < 200; ++tries) {
    const int* s = spans[tries % 2];
    if (s[1] < s[0]) continue;
    const int port = std::uniform_int_distribution<int>(s[0], s[1])(gen);
    if (PortBinds(port) && (!pair || PortBinds(port + 1))) return port;
  }
  errno = EADDRINUSE;
  return -1;
}

}  // namespace strata::net

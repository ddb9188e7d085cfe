"""Loopback ports for the multi-rank tests: a block of consecutive ports that
nobody listens on now, outside the kernel's ephemeral range.

Why not bind port 0: the kernel answers from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), the range it also gives every
outgoing connection its local port from. A test that then uses port + 1,
+ 2, ... (torch's store on MASTER_PORT, each Strata engine's store above it)
finds one of them taken by some other test's Gloo or store connection, and
its listen fails with "port in use" (CI, python_ddp_test_torch2). A port
below the ephemeral range is never handed out to a connection; only another
listener can hold it, and a random block that binds now is free of those.
Usage: from free_ports import free_port_block; base = free_port_block(32)"""
import random
import socket

_FLOOR = 20000  # below: the well-known and registered ports of common services


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _binds(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_block(n=1, tries=200):
    """The first of n consecutive loopback ports that all bind now, none of
    them in the ephemeral range. Raises RuntimeError when none is found."""
    lo, hi = _ephemeral_range()
    spans = [(a, b) for a, b in ((_FLOOR, lo - 1), (hi + 1, 65535)) if b - a + 1 >= n]
    if not spans:
        raise RuntimeError(f"no room for {n} ports outside the ephemeral range {lo}-{hi}")
    rng = random.SystemRandom()
    for _ in range(tries):
        a, b = rng.choice(spans)
        base = rng.randint(a, b - n + 1)
        if all(_binds(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} free consecutive loopback ports outside {lo}-{hi} after {tries} tries")


def free_port():
    return free_port_block(1)

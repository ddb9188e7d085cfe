"""A switch in user space whose links delay and drop frames, as tc netem
would (for kernels built without netem, like this project's test machines).

Each host namespace gets a TAP device eth0 (made by this process inside the
namespace, gone when it exits); the switch learns MAC addresses and
forwards every frame to its port, or floods it while the port is unknown.
Each link (host <-> switch) delays every frame by --delay-ms and drops it
with probability --loss, independently per direction, so a frame between
two hosts crosses two links: twice the delay, two chances of loss. Order is
kept on each link (a fixed delay, as netem without jitter). Seeded: the same
--seed drops the same frames of the same stream.

Usage: link_switch.py --ready FILE [--delay-ms D] [--loss P] [--seed S] NS...
Writes FILE once every TAP exists; on SIGTERM writes the counts
("frames N dropped K") to FILE.stats and exits."""
import argparse
import collections
import ctypes
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000

libc = ctypes.CDLL(None, use_errno=True)


def setns(fd):
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tap(ns):
    """A TAP named eth0 inside network namespace `ns`; its fd."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        setns(target)
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"eth0", IFF_TAP | IFF_NO_PI))
    finally:
        setns(home)
        os.close(target)
        os.close(home)
    os.set_blocking(fd, False)
    return fd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready", required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("ns", nargs="+")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    delay = a.delay_ms / 1000.0
    fds = [open_tap(ns) for ns in a.ns]
    port_of = {fd: i for i, fd in enumerate(fds)}
    macs = {}  # MAC -> port
    queues = [collections.deque() for _ in fds]  # per egress link: (due, frame)
    counts = {"frames": 0, "dropped": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with open(a.ready + ".tmp", "w") as f:
        f.write("ready\n")
    os.rename(a.ready + ".tmp", a.ready)

    def lost():
        return a.loss > 0 and rng.random() < a.loss

    while not stop:
        now = time.monotonic()
        wait = None
        for q in queues:
            if q:
                wait = max(0.0, q[0][0] - now) if wait is None else min(wait, max(0.0, q[0][0] - now))
        try:
            ready, _, _ = select.select(fds, [], [], 0.2 if wait is None else wait)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in ready:
            src = port_of[fd]
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    frame = b""
                if not frame:
                    break
                counts["frames"] += 1
                if lost():  # the sender's link
                    counts["dropped"] += 1
                    continue
                if len(frame) >= 12:
                    macs[frame[6:12]] = src
                out = macs.get(frame[0:6])
                ports = [out] if out is not None and out != src else [p for p in range(len(fds)) if p != src]
                for p in ports:
                    if lost():  # the receiver's link
                        counts["dropped"] += 1
                        continue
                    queues[p].append((now + 2 * delay, frame))
        now = time.monotonic()
        for p, q in enumerate(queues):
            while q and q[0][0] <= now:
                try:
                    os.write(fds[p], q.popleft()[1])
                except OSError:
                    pass  # the host's interface is down: the frame is lost, as on a wire
    with open(a.ready + ".stats", "w") as f:
        f.write(f"frames {counts['frames']} dropped {counts['dropped']}\n")


if __name__ == "__main__":
    sys.exit(main())

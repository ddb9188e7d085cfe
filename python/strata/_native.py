"""The native engine's lifetime (strata_engine_t*): one lease per holder
(the Engine, each tensor that views its memory, each call in flight), the
last one destroying it; never destroyed in a process forked from its
maker's; closed engines still viewed at exit destroyed then."""
import atexit
import os
import weakref


# This process's id, kept current in forked children (os.register_at_fork):
# Engine.handle compares it with its engine's (current_pid).
_this_pid = os.getpid()


def _after_fork_in_child():
    global _this_pid
    _this_pid = os.getpid()


def current_pid():
    """This process's id, without a system call."""
    return _this_pid


os.register_at_fork(after_in_child=_after_fork_in_child)

_NATIVES = weakref.WeakSet()  # every _NativeEngine of the process (and those a fork copied)


def _live_native_engines():
    """How many native engines this process made are not destroyed yet
    (a debugging aid: a closed Engine whose views live counts until they go)."""
    return sum(1 for n in list(_NATIVES) if n.h is not None and n.pid == os.getpid())


class _NativeEngine:
    """The native engine (strata_engine_t*), shared by its Engine and by each
    tensor that views the engine's memory (as_tensor): each holds a
    reference, and the last one to go destroys it (Python's reference count
    is the lease count, atomic under the GIL, so that the last holder may be
    a tensor freed on any thread). In a process forked from the one that made
    it, it is dropped without being destroyed: the engine's threads, files and
    device memory are the parent's (the child has none of its threads; joining
    them aborts or hangs)."""

    def __init__(self, lib, h):
        self.lib, self.h, self.pid = lib, h, os.getpid()
        self.getpid = os.getpid  # (bound now: __del__ may run at shutdown, after the module's globals went)
        self.views = weakref.WeakSet()  # the objects as_tensor's tensors hold (their lease)
        self.closed = False  # its Engine was closed: destroyed with the last view, at exit at the latest
        _NATIVES.add(self)

    # ctypes passes it as its handle, and the call's arguments hold it: an
    # Engine closed by another thread while a call of its runs (a trainer's
    # watchdog, a signal handler) no longer destroys the engine under that
    # call (a segfault): the call's end lets go of the last reference.
    @property
    def _as_parameter_(self):
        return self.h

    def destroy(self):
        h, self.h = self.h, None
        if h is not None and self.pid == self.getpid():
            self.lib.strata_engine_destroy(h)  # joins its threads, removes its swap files, writes the trace

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # interpreter shutdown
            pass


@atexit.register
def _destroy_closed_engines():
    """A closed Engine whose views are still referenced at exit: destroyed
    now, so that its swap files go (a view read after this, in a finalizer
    at shutdown, would read freed memory)."""
    for native in list(_NATIVES):
        if native.closed:
            native.destroy()

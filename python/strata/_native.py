"""The native engine's lifetime (strata_engine_t*): one lease per holder
(the Engine, each tensor that views its memory, each call in flight), the
last one destroying it; never destroyed in a process forked from its
maker's; closed engines still viewed at exit destroyed then, and in a
multiprocessing child every engine it made, at its exit (at_child_exit)."""
import atexit
import os
import sys
import threading
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


# ---- multiprocessing children ------------------------------------------------
# multiprocessing ends a child it forked (start methods "fork" and
# "forkserver": a Process, a Pool's worker) with os._exit once its exit
# handler (multiprocessing.util._exit_function) has run: atexit and
# weakref.finalize's exit hook never run there, and an engine left for exit
# to free kept its swap files and never wrote its trace. In such a child the
# cleanups are also registered as multiprocessing finalizers, which that
# handler runs (a spawned child runs them there too, before atexit; each
# cleanup runs at most once whichever runs it first).

# Below 0: after the handler's finalizers of priority >= 0 (a Pool's, a
# Queue's) and after it ended its own daemonic children; _join_other_threads
# one above, before the cleanups.
_CHILD_EXIT_PRIORITY = -100
_joiner_pid = None  # the process whose finalizers hold _join_other_threads


def _in_multiprocessing_child():
    """Whether this process is a multiprocessing child (the module is in
    sys.modules in every one: their start goes through it)."""
    proc = sys.modules.get("multiprocessing.process")
    if proc is None:
        return False
    try:
        return proc.parent_process() is not None or proc.current_process().name != "MainProcess"
    except Exception:  # (a multiprocessing without parent_process, or torn down)
        return False


def _join_other_threads():
    """The child's non-daemon threads, which may still drive an engine (its
    target returned; interpreter exit would join them before atexit), are
    joined before the cleanups free the engines under them. (multiprocessing
    joins them after its exit handler, before os._exit: it would anyway.)"""
    me, main = threading.current_thread(), threading.main_thread()
    for t in threading.enumerate():
        if t is not me and t is not main and not t.daemon and t.is_alive():
            t.join()


def at_child_exit(obj, callback, *args):
    """In a multiprocessing child: callback(*args) runs also as the child
    exits (multiprocessing.util.Finalize), in this process only (the
    Finalize's pid check: never in a process forked from this one); also
    when obj is collected (the Finalize then goes from the registry, so that
    a child making engines in a loop does not grow it), obj None: never.
    The Finalize holds callback and args: neither may hold obj, or what must
    be collectable (pass weak references or a weakref.finalize). The callback
    must be a no-op once its cleanup ran another way. Returns the Finalize,
    or None outside a child."""
    global _joiner_pid
    if not _in_multiprocessing_child():
        return None
    from multiprocessing import util
    pid = os.getpid()
    if _joiner_pid != pid:  # (a fork of a child has its own to register)
        _joiner_pid = pid
        util.Finalize(None, _join_other_threads, exitpriority=_CHILD_EXIT_PRIORITY + 1)
    return util.Finalize(obj, callback, args=args, exitpriority=_CHILD_EXIT_PRIORITY)


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
        # In a multiprocessing child, destroyed at its exit, closed or not,
        # views or not (exit would free it: atexit, or the collection of the
        # module that holds its Engine). A weak reference: it must not keep
        # this alive.
        at_child_exit(self, _destroy_at_child_exit, weakref.ref(self))

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


def _destroy_at_child_exit(ref):
    native = ref()
    if native is not None:  # (None: collected, so destroyed already)
        native.destroy()


@atexit.register
def _destroy_closed_engines():
    """A closed Engine whose views are still referenced at exit: destroyed
    now, so that its swap files go (a view read after this, in a finalizer
    at shutdown, would read freed memory)."""
    for native in list(_NATIVES):
        if native.closed:
            native.destroy()

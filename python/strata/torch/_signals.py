"""Ctrl-C deferred over the sections that must run whole.

CPython runs a Python SIGINT handler (default_int_handler, which raises
KeyboardInterrupt) at the next point the interpreter checks for signals:
as a native call returns, at the start of a Python function. strata.torch
finishes or undoes an operation that such an interrupt cut short (the
engine's step finished, a fetch the native call made released, what a
step consumed put back) before letting the KeyboardInterrupt go on; a
second Ctrl-C arriving while that ran cut the repair short in turn and
left the state wrong again (a group left fetched: every later step STATE;
the weights a step behind their masters). deferred() holds SIGINT over
such a section: one that arrives is recorded, and raised as
KeyboardInterrupt when the section ends; where an exception goes on from
the section (the interrupt being repaired, or another) it is dropped, one
KeyboardInterrupt being on its way to the caller already.

Only on the main thread (the only one Python runs signal handlers on) and
only where SIGINT's handler is Python's default_int_handler: a program's
own handler (a trainer that saves a checkpoint on Ctrl-C, a debugger) is
left as it is, and a section inside another is the outer one's. A use
costs about 0.8 microseconds (two sigaction calls): it guards the repairs
(which run only after an interrupt or a failure) and per-step sections,
never a forward's fetch or release on their ordinary path. A signal that
arrives in the few bytecodes between an `except` clause's start and the
handler's installation is still delivered there (no Python code can
close that window, microseconds long).

The fetches and releases of strata.Engine undo themselves where an
interrupt lands in them (Engine.fetch releases a fetch whose address was
lost; _release_held releases again), in code that runs before any caller's
except clause could defer a second one: fetch() and release_held() here
repeat that undo, deferred, where it may have been cut short.
"""

import signal
import threading

from .. import Error

try:  # the C functions: signal.py's wrappers look each handler up in an enum (about 3 microseconds a call)
    from _signal import getsignal as _getsignal, signal as _setsignal
except ImportError:
    _getsignal, _setsignal = signal.getsignal, signal.signal

_SIGINT = signal.SIGINT
_default_int_handler = signal.default_int_handler
_get_ident = threading.get_ident
_main_thread = threading.main_thread


class deferred:
    """Context: SIGINT held until it ends, then raised as KeyboardInterrupt
    unless an exception goes on from it (see the module's docstring)."""
    __slots__ = ("_installed", "_pending")

    def __enter__(self):
        self._installed = self._pending = False
        if _get_ident() == _main_thread().ident and _getsignal(_SIGINT) is _default_int_handler:
            try:
                _setsignal(_SIGINT, self._record)
            except ValueError:  # (not the interpreter's main thread after all: a sub-interpreter)
                return self
            self._installed = True
        return self

    def _record(self, signum, frame):
        self._pending = True

    def __exit__(self, exc_type, exc, tb):
        if self._installed:
            self._installed = False
            # (signal.signal first runs the handlers of signals that arrived
            # just before it: SIGINT's is ours still, which records it;
            # another's that raises leaves SIGINT's as it was: again.)
            try:
                _setsignal(_SIGINT, _default_int_handler)
            except BaseException:
                _setsignal(_SIGINT, _default_int_handler)
                raise
            if self._pending and exc_type is None:
                self._pending = False
                raise KeyboardInterrupt
        return False


def release_again(engine, group, stream=None):
    """Releases `group` where an interrupt may have cut short the undo of a
    fetch its caller held alone: released if it is still fetched, nothing
    where it is not (the engine's STATE for a group released already).
    Inside deferred()."""
    try:
        engine.release(group, stream)
    except Error:
        pass


def fetch(engine, group, stream=None, tensor=False):
    """engine.fetch(group) (tensor: fetch_tensor) of a group the caller
    will hold alone. Where it raises other than with the engine's Error
    (a Ctrl-C), Engine's own undo of a fetch made (a release) may have been
    cut short by a second one: it is repeated, deferred, and the exception
    goes on."""
    try:
        return (engine.fetch_tensor if tensor else engine.fetch)(group, stream=stream)
    except Error:
        raise
    except BaseException:
        with deferred():
            release_again(engine, group, stream)
            raise


def release_held(engine, group, stream=None):
    """engine._release_held(group): a group the caller fetched once and
    holds alone, released also where interrupts land in the release and in
    its second try (that one repeated, deferred)."""
    try:
        engine._release_held(group, stream=stream)
    except Error:
        raise
    except BaseException:
        with deferred():
            release_again(engine, group, stream)
            raise

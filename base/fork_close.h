// Descriptors a child of fork must not keep: an engine works only in the
// process that created it, and what its descriptors hold outlives the
// parent's close while any child has a copy (a swap file's flock, which
// refuses the next engine in that folder, and its deleted space; a rank's
// listening socket, which refuses the next job's store on that port; a
// peer connection, which hides the parent's death from the other ranks).
// Those registered here are closed in the child at fork (pthread_atfork),
// before fork returns there: each only where its number still names the
// file it named when registered.
#pragma once

namespace strata {

// `fd` is closed in every child forked from now on, until ForgetInForkChild.
void CloseInForkChild(int fd);
// The same, and FD_CLOEXEC set (a program a child executes keeps none
// either): for sockets made by libraries that set neither (asio, Gloo).
void KeepFromForkAndExec(int fd);
// Before `fd` is closed in this process (the number may be reused).
void ForgetInForkChild(int fd);
// Whether `fd` is registered (for tests).
bool ClosedInForkChild(int fd);

}  // namespace strata

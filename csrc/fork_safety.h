// fork() awareness of the native layer's process-wide state.
//
// After fork() the child is a copy of the parent with one thread. Page locks (mlock) and device registrations are
// not inherited, a mutex held by another parent thread stays locked forever, and a reader slot claimed by another
// thread stays "reading" forever. The handlers installed here (pthread_atfork, once per process) therefore:
//   prepare  hold every registry writer mutex and the live-allocation table's mutex, so no writer is half-way
//            through an update when the address space is copied (readers never lock and need no such care);
//   parent   release them;
//   child    advance the fork generation (every allocation made before it is now "inherited"), apply the fork
//            rule to the inherited allocations (docs/native.md, "fork()"), forget the vanished threads' reader
//            slots, and release the locks.
// Per-thread and per-process caches that depend on the process (the CUDA context probe, the is_pinned miss
// answer) compare the generation they were filled in with fork_generation() instead of needing a handler.
#pragma once

#include <cstdint>

namespace hostoffload {

// 0 in a process that has not been forked from one using this module; +1 in each forked child (a grandchild
// of a forked child: +2, ...). Lock-free, async-signal-safe to read.
std::uint64_t fork_generation();

// Installs the handlers (idempotent, thread-safe). Returns 0, or the error number pthread_atfork returned.
int install_fork_handlers();

}  // namespace hostoffload

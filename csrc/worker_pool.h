// A persistent pool of worker threads for the native CPU kernels (issue 6): block-parallel loops over [0, n).
//
// Why a pool: the optimizer step is called once per parameter buffer, every training step; starting and joining
// threads on every call cost more than the step itself below a few million parameters. Why dynamic blocks: on a
// shared or virtualised host some vCPUs run slower than others (hyper-thread siblings, noisy neighbours), and a
// static split makes every call wait for the slowest thread; claiming fixed-size blocks from an atomic counter lets
// fast threads take more of them.
//
// Contract:
//  * parallel_for(n, block, threads, fn, ctx) calls fn(ctx, lo, hi) on disjoint ranges covering [0, n) exactly
//    once, each range one block [k*block, min(n, (k+1)*block)), on at most `threads` threads; the calling thread
//    always works, so the loop completes even if no worker could be started. It returns after every range has
//    finished; an exception thrown by fn (the kernels never throw) is rethrown in the caller after all ranges that
//    had started have finished.
//  * Thread-safe: concurrent calls are serialised on a mutex held for the parallel section (the pool runs one loop
//    at a time; a second caller waits, then gets the whole pool).
//  * Fork-safe: the pool remembers the pid that built it; in a forked child (which has none of the parent's
//    threads, and possibly a copy of a mutex locked by one of them) a fresh pool is built and the parent's copy
//    is never touched.
//  * Created lazily, grown when a call asks for more threads than it has, never shrunk. Workers are detached and
//    the pool is deliberately never destroyed: at process exit the workers are idle on a condition variable in
//    heap memory no static destructor touches, so exit never joins (joining from a static destructor after Python
//    finalisation can deadlock) and never blocks. A worker that cannot be started (EAGAIN, ENOMEM) is simply not
//    added; the pool then stops trying to grow beyond the size it reached. It never exceeds 1024 workers.
#pragma once

#include <cstddef>

namespace hostoffload {
namespace worker_pool {

using RangeFn = void (*)(void* ctx, std::size_t lo, std::size_t hi);

void parallel_for(std::size_t n, std::size_t block, int threads, RangeFn fn, void* ctx);

// Number of worker threads (callers excluded) the current process's pool has started; 0 before first use.
std::size_t started_workers();

template <typename Body>
void parallel_blocks(std::size_t n, std::size_t block, int threads, const Body& body) {
    parallel_for(
        n, block, threads, [](void* c, std::size_t lo, std::size_t hi) { (*static_cast<const Body*>(c))(lo, hi); },
        const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace worker_pool
}  // namespace hostoffload

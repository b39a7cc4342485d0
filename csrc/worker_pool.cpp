// Persistent worker pool for the native CPU kernels (contract in worker_pool.h).
//
// One job at a time (run_mutex_). Publishing a job: under mutex_, store it, reset the block counter, bump the
// generation and open the job; workers with an index below `participants_` that see the new generation while the
// job is open register as in flight and claim blocks until the counter passes the end. The caller claims blocks
// too, then closes the job and waits only for the workers in flight: a worker that wakes after the caller has
// closed the job does nothing, so a slow wake-up never delays the caller once the blocks are done.
//
// Wake-up latency: after a job, a worker spins on the published generation for a short while (kSpin) before it
// sleeps on the condition variable, so back-to-back calls (one per parameter buffer) do not pay a futex wake-up
// each; it does not spin when the pool has more threads than this process may run on (spinning would then steal
// the CPU from the threads doing the work).
#include "worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HOSTOFFLOAD_PAUSE() _mm_pause()
#else
#define HOSTOFFLOAD_PAUSE() std::this_thread::yield()
#endif

namespace hostoffload {
namespace worker_pool {
namespace {

constexpr std::chrono::microseconds kSpin{50};
// Upper bound on the pool's workers, whatever a caller asks for: a memory-bound loop gains nothing from thousands
// of threads, and a typo (threads=100000) must not exhaust the process's thread limit. Callers still get the
// whole loop done, on fewer threads.
constexpr std::size_t kMaxWorkers = 1024;

struct Job {
    RangeFn fn;
    void* ctx;
    std::size_t n;
    std::size_t block;
    std::size_t nblocks;
};

std::size_t allowed_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        const int count = CPU_COUNT(&set);
        if (count > 0) return static_cast<std::size_t>(count);
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : hw;
}

class Pool {
public:
    explicit Pool(pid_t pid) : pid_(pid) {}
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    pid_t pid() const { return pid_; }

    std::size_t started() {
        std::lock_guard<std::mutex> lk(mutex_);
        return workers_;
    }

    void run(const Job& job, int threads) {
        std::lock_guard<std::mutex> serial(run_mutex_);
        const std::size_t want = std::min(static_cast<std::size_t>(threads) - 1, job.nblocks - 1);
        if (want > workers_) grow(want);
        std::size_t helpers;
        bool wake;
        {
            std::lock_guard<std::mutex> lk(mutex_);
            helpers = std::min(want, workers_);
            if (helpers == 0) {
                // No worker could ever be started: the caller does it all (below, outside the lock).
                wake = false;
            } else {
                job_ = &job;
                next_.store(0, std::memory_order_relaxed);
                error_ = nullptr;
                participants_ = helpers;
                open_ = true;
                ++generation_;
                published_.store(generation_, std::memory_order_release);
                wake = sleepers_ > 0;
            }
        }
        if (helpers == 0) {
            for (std::size_t b = 0; b < job.nblocks; ++b) run_block(job, b);
            return;
        }
        if (wake) work_cv_.notify_all();
        std::exception_ptr failure;
        try {
            drain(job);
        } catch (...) {
            failure = std::current_exception();
            next_.store(job.nblocks, std::memory_order_relaxed);  // the others stop claiming
        }
        {
            std::unique_lock<std::mutex> lk(mutex_);
            open_ = false;
            done_cv_.wait(lk, [this] { return in_flight_ == 0; });
            job_ = nullptr;
            if (!failure) failure = error_;
            error_ = nullptr;
        }
        if (failure) std::rethrow_exception(failure);
    }

private:
    static void run_block(const Job& job, std::size_t b) {
        const std::size_t lo = b * job.block;
        job.fn(job.ctx, lo, std::min(job.n, lo + job.block));
    }

    void drain(const Job& job) {
        for (;;) {
            const std::size_t b = next_.fetch_add(1, std::memory_order_relaxed);
            if (b >= job.nblocks) return;
            run_block(job, b);
        }
    }

    // Called with run_mutex_ held (no job open). Workers start with every signal blocked, so asynchronous
    // signals keep going to the application's own threads (Python handles them on the main thread).
    void grow(std::size_t want) {
        if (want > ceiling_) want = ceiling_;
        if (want <= workers_) return;
        sigset_t all;
        sigset_t previous;
        const bool masked = sigfillset(&all) == 0 && pthread_sigmask(SIG_SETMASK, &all, &previous) == 0;
        std::size_t started = workers_;
        std::uint64_t seen;
        {
            std::lock_guard<std::mutex> lk(mutex_);
            seen = generation_;
        }
        for (; started < want; ++started) {
            try {
                std::thread([this, started, seen] { worker_main(started, seen); }).detach();
            } catch (const std::exception&) {  // std::system_error (EAGAIN) or std::bad_alloc: stay smaller
                ceiling_ = started;
                break;
            }
        }
        if (masked) {
            // Restoring the mask we read cannot fail (the only error is an invalid `how`); nothing to undo if it did.
            (void)pthread_sigmask(SIG_SETMASK, &previous, nullptr);
        }
        std::lock_guard<std::mutex> lk(mutex_);
        workers_ = started;
        spin_.store(workers_ + 1 <= cpus_, std::memory_order_relaxed);
    }

    void worker_main(std::size_t index, std::uint64_t seen) {
        std::unique_lock<std::mutex> lk(mutex_);
        for (;;) {
            if (generation_ == seen && spin_.load(std::memory_order_relaxed)) {
                lk.unlock();
                const auto until = std::chrono::steady_clock::now() + kSpin;
                for (unsigned i = 1; published_.load(std::memory_order_acquire) == seen; ++i) {
                    HOSTOFFLOAD_PAUSE();
                    if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
                }
                lk.lock();
            }
            if (generation_ == seen) {
                ++sleepers_;
                work_cv_.wait(lk, [this, seen] { return generation_ != seen; });
                --sleepers_;
            }
            seen = generation_;
            if (!open_ || index >= participants_) continue;
            ++in_flight_;
            const Job job = *job_;
            lk.unlock();
            std::exception_ptr failure;
            try {
                drain(job);
            } catch (...) {
                failure = std::current_exception();
                next_.store(job.nblocks, std::memory_order_relaxed);
            }
            lk.lock();
            if (failure && !error_) error_ = failure;
            if (--in_flight_ == 0) done_cv_.notify_all();
        }
    }

    const pid_t pid_;
    const std::size_t cpus_ = allowed_cpus();
    std::mutex run_mutex_;             // serialises parallel sections: one job at a time
    std::size_t ceiling_ = kMaxWorkers;  // run_mutex_: no growth beyond this (lowered when creation fails)
    std::mutex mutex_;                 // guards everything below except the atomics
    std::condition_variable work_cv_;  // generation_ changed
    std::condition_variable done_cv_;  // in_flight_ reached 0
    std::uint64_t generation_ = 0;
    std::atomic<std::uint64_t> published_{0};  // generation_, for spinning workers (read without the lock)
    std::atomic<bool> spin_{false};
    bool open_ = false;
    std::size_t participants_ = 0;  // workers with index < participants_ join the open job
    std::size_t in_flight_ = 0;
    std::size_t sleepers_ = 0;
    std::size_t workers_ = 0;  // started workers (written under both mutexes)
    const Job* job_ = nullptr;
    std::atomic<std::size_t> next_{0};  // next unclaimed block of the open job
    std::exception_ptr error_;
};

// The pool of this process. Lock-free so that a forked child never waits on a lock a parent thread held at fork
// time: a pool built by another pid is left untouched (leaked; its threads do not exist in the child).
std::atomic<Pool*> g_pool{nullptr};

Pool* pool_for_this_process() {
    const pid_t pid = getpid();
    Pool* current = g_pool.load(std::memory_order_acquire);
    while (current == nullptr || current->pid() != pid) {
        Pool* fresh = new (std::nothrow) Pool(pid);
        if (fresh == nullptr) return nullptr;
        if (g_pool.compare_exchange_strong(current, fresh, std::memory_order_acq_rel)) return fresh;
        delete fresh;  // another thread installed one first: `current` now holds it, re-check its pid
    }
    return current;
}

}  // namespace

void parallel_for(std::size_t n, std::size_t block, int threads, RangeFn fn, void* ctx) {
    if (n == 0) return;
    if (block == 0) block = n;
    const std::size_t nblocks = n / block + (n % block != 0 ? 1 : 0);
    if (threads <= 1 || nblocks <= 1) {
        fn(ctx, 0, n);
        return;
    }
    Pool* pool = pool_for_this_process();
    const Job job{fn, ctx, n, block, nblocks};
    if (pool == nullptr) {  // out of memory for the pool object: run here, block by block
        for (std::size_t lo = 0; lo < n; lo += block) fn(ctx, lo, std::min(n, lo + block));
        return;
    }
    pool->run(job, threads);
}

std::size_t started_workers() {
    Pool* pool = g_pool.load(std::memory_order_acquire);
    if (pool == nullptr || pool->pid() != getpid()) return 0;
    return pool->started();
}

}  // namespace worker_pool
}  // namespace hostoffload

// Native pinned host allocations; see host_allocator.h.
#include "host_allocator.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_loader.h"
#include "fork_safety.h"
#include "range_registry.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we touch pages instead
#endif
#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 0x01
#endif
#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif

namespace hostoffload {

namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
// Automatic population threads: one per 256 MiB, at most 4 (and at most the CPU count). Measured on the H200
// box (16 vCPUs, THP, 4 GiB buffer, see docs/native.md): populate took 0.78 s with 1 thread, 0.21 s with 4,
// 0.42 s with 8 and 0.35-0.49 s with 16. Page faults scale only to a few threads there (zeroing bandwidth and
// the kernel's page-allocator locks are shared); HOSTOFFLOAD_PIN_POPULATE_THREADS overrides it elsewhere.
constexpr std::size_t kBytesPerPopulateThread = std::size_t{256} << 20;
constexpr int kMaxPopulateThreads = 4;

enum Phase { kPhaseMap, kPhasePopulate, kPhaseLock, kPhaseRegister, kPhaseRegistry };

std::atomic<std::uint64_t> g_next_id{1};
std::atomic<std::int64_t> g_allocations{0};
std::atomic<std::int64_t> g_bytes{0};
std::atomic<std::int64_t> g_registered_bytes{0};
std::atomic<std::int64_t> g_unpinned_alive{0};
std::atomic<std::int64_t> g_release_errors{0};

struct LiveEntry {
    std::weak_ptr<Allocation> allocation;
    std::uint64_t start;  // its range's first byte (still known once the allocation is expiring)
};

struct LiveTable {
    std::mutex mutex;
    std::unordered_map<std::uint64_t, LiveEntry> by_id;
};

LiveTable& live_table() {
    static LiveTable* table = new LiveTable();  // immortal, like the registry (late deleters use it)
    return *table;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Faults [p, p + n) in, writable. Returns 0 or an errno value.
int populate(char* p, std::size_t n) {
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno;
    const std::size_t page = host_page_size();
    for (std::size_t off = 0; off < n; off += page) {
        *static_cast<volatile char*>(p + off) = 0;  // fresh anonymous memory is zero: this changes nothing
    }
    return 0;
}

// Faults [base, base + n) in on `threads` workers. If `meanwhile` is set, the calling thread runs it while the
// workers fault (used to overlap device registration with population); otherwise a single-thread request is
// done inline. Returns 0 or the first errno value.
int populate_parallel(char* base, std::size_t n, int threads, const std::function<void()>& meanwhile) {
    if (threads <= 1 && !meanwhile) return populate(base, n);
    threads = std::max(threads, 1);
    // Split on huge-page boundaries so no 2 MiB page is faulted by two threads at once.
    const std::size_t per = round_up((n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads),
                                     kHugePage);
    std::vector<int> errors(static_cast<std::size_t>(threads), 0);
    std::vector<std::thread> workers;
    workers.reserve(static_cast<std::size_t>(threads));
    std::size_t inline_from = n;  // if a thread cannot start, the rest is populated here
    for (int i = 0; i < threads; ++i) {
        const std::size_t off = per * static_cast<std::size_t>(i);
        if (off >= n) break;
        const std::size_t len = std::min(per, n - off);
        try {
            workers.emplace_back(
                [&errors, i, base, off, len] { errors[static_cast<std::size_t>(i)] = populate(base + off, len); });
        } catch (const std::system_error&) {
            inline_from = off;
            break;
        }
    }
    std::exception_ptr failed;  // the workers must be joined before anything propagates
    if (meanwhile) {
        try {
            meanwhile();
        } catch (...) {
            failed = std::current_exception();
        }
    }
    int err = inline_from < n ? populate(base + inline_from, n - inline_from) : 0;
    for (auto& w : workers) w.join();
    if (failed) std::rethrow_exception(failed);
    for (int e : errors) err = err != 0 ? err : e;
    return err;
}

int choose_threads(std::size_t n, int requested) {
    if (requested > 0) return requested;
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    const std::size_t by_size = std::max<std::size_t>(1, n / kBytesPerPopulateThread);
    return static_cast<int>(std::min<std::size_t>({by_size, hw, static_cast<std::size_t>(kMaxPopulateThreads)}));
}

int lock_on_fault(void* p, std::size_t n) {
#ifdef SYS_mlock2
    if (syscall(SYS_mlock2, p, n, MLOCK_ONFAULT) == 0) return 0;
    if (errno != ENOSYS && errno != EINVAL) return errno;
#endif
    return -1;  // not supported: lock after populating instead
}

}  // namespace

std::size_t host_page_size() {
    static const std::size_t page = [] {
        const long p = sysconf(_SC_PAGESIZE);
        return p > 0 ? static_cast<std::size_t>(p) : std::size_t{4096};
    }();
    return page;
}

PinnedCounters pinned_counters() {
    return PinnedCounters{g_allocations.load(), g_bytes.load(), g_registered_bytes.load(), g_unpinned_alive.load(),
                          g_release_errors.load()};
}

std::shared_ptr<Allocation> Allocation::create(const AllocRequest& req) {
    const std::size_t page = host_page_size();
    // Same rounding as the reference: whole pages, at least one (a zero-byte tensor still gets an address).
    const std::size_t size = std::max(page, round_up(req.nbytes, page));
    if (size < req.nbytes) throw HostAllocError("cannot allocate " + std::to_string(req.nbytes) + " bytes: too large");

    std::shared_ptr<Allocation> a(new Allocation());
    a->slab_ = req.slab;
    a->generation_ = fork_generation();
    auto t0 = std::chrono::steady_clock::now();

    // -- map ------------------------------------------------------------------------------------------------
    const bool want_huge = req.huge_pages != HugePageMode::kOff && size >= kHugePage;
    if (want_huge && req.huge_pages == HugePageMode::kHugetlb) {
        const std::size_t hsize = round_up(size, kHugePage);
        void* p = mmap(nullptr, hsize, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | (21 << MAP_HUGE_SHIFT), -1, 0);
        if (p != MAP_FAILED) {
            a->map_base_ = a->data_ = p;
            a->map_len_ = a->size_ = hsize;
            a->page_kind_ = "hugetlb";
        }
        // else: no reserved huge pages (the usual case): fall back to transparent huge pages below.
    }
    if (a->map_base_ == nullptr) {
        // Over-map by one huge page so the buffer can start on a 2 MiB boundary, then trim both ends.
        const std::size_t extra = want_huge ? kHugePage : 0;
        void* p = mmap(nullptr, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            const int err = errno;
            throw HostAllocError("mmap of " + std::to_string(size) + " bytes failed: " + errno_text(err));
        }
        a->map_base_ = p;
        a->map_len_ = size + extra;
        a->data_ = p;
        a->size_ = size;
        if (want_huge) {
            auto* base = static_cast<char*>(p);
            char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<std::uintptr_t>(base), kHugePage));
            const std::size_t head = static_cast<std::size_t>(aligned - base);
            const std::size_t tail = extra - head;
            // Trimming cannot fail on a mapping we own with page-aligned bounds; if it does, keep the slack.
            if (head > 0 && munmap(base, head) == 0) {
                a->map_base_ = aligned;
                a->map_len_ -= head;
            }
            if (tail > 0 && munmap(aligned + size, tail) == 0) a->map_len_ -= tail;
            a->data_ = aligned;
            if (madvise(aligned, size, MADV_HUGEPAGE) == 0) a->page_kind_ = "thp";
        }
    }
    a->phase_seconds_[kPhaseMap] = seconds_since(t0);

    // -- lock (on fault) and populate ------------------------------------------------------------------------
    // Locking before populating makes a too-small RLIMIT_MEMLOCK fail at once instead of after faulting in
    // gigabytes, and lets the population threads lock each page as they fault it (no second walk).
    t0 = std::chrono::steady_clock::now();
    const int lock_rc = lock_on_fault(a->data_, a->size_);
    if (lock_rc > 0) {
        throw LockError("cannot page-lock " + std::to_string(a->size_) + " bytes of host memory (mlock: " +
                        errno_text(lock_rc) + ")");
    }
    if (lock_rc == 0) a->locked_len_ = a->size_;
    a->phase_seconds_[kPhaseLock] = seconds_since(t0);

    // -- populate, and register with the device (after population, or overlapped with it) ---------------------
    auto register_now = [&a, &req] {
        const auto r0 = std::chrono::steady_clock::now();
        a->register_error_ = CudaHostApi::host_register(a->data_, a->size_, req.cuda_flags);
        a->cuda_registered_ = a->register_error_.empty();
        a->registered_.store(a->cuda_registered_, std::memory_order_release);
        a->phase_seconds_[kPhaseRegister] = seconds_since(r0);
    };
    // Overlap: cudaHostRegister faults in whatever is still missing itself, so it can start while the workers
    // are still faulting pages in; the two then share the wall time instead of adding up.
    const bool overlap = req.register_cuda && req.overlap_register;
    t0 = std::chrono::steady_clock::now();
    const int pop_err = populate_parallel(static_cast<char*>(a->data_), a->size_,
                                          choose_threads(a->size_, req.populate_threads),
                                          overlap ? std::function<void()>(register_now) : std::function<void()>());
    a->phase_seconds_[kPhasePopulate] = seconds_since(t0);
    if (pop_err != 0) {
        throw HostAllocError("faulting in " + std::to_string(a->size_) + " bytes of host memory failed: " +
                             errno_text(pop_err));
    }
    if (a->locked_len_ == 0) {
        t0 = std::chrono::steady_clock::now();
        if (mlock(a->data_, a->size_) != 0) {
            const int err = errno;
            throw LockError("cannot page-lock " + std::to_string(a->size_) + " bytes of host memory (mlock: " +
                            errno_text(err) + ")");
        }
        a->locked_len_ = a->size_;
        a->phase_seconds_[kPhaseLock] += seconds_since(t0);
    }
    if (req.register_cuda && !overlap) register_now();

    // -- range registry and bookkeeping ---------------------------------------------------------------------
    t0 = std::chrono::steady_clock::now();
    a->id_ = g_next_id.fetch_add(1);
    {
        LiveTable& table = live_table();
        std::lock_guard<std::mutex> lock(table.mutex);
        table.by_id.emplace(a->id_, LiveEntry{a, a->data()});  // cannot collide: ids are never reused
    }
    a->in_table_ = true;
    RangeRegistry::global().add(a->data(), a->size_, a->id_);  // throws only on a bookkeeping bug
    a->in_registry_ = true;
    // Nothing below can throw: from here on the allocation is counted and unpin() can find it.
    a->published_ = true;
    a->pinned_.store(true, std::memory_order_release);
    g_allocations.fetch_add(1);
    g_bytes.fetch_add(static_cast<std::int64_t>(a->size_));
    if (a->cuda_registered_) g_registered_bytes.fetch_add(static_cast<std::int64_t>(a->size_));
    a->phase_seconds_[kPhaseRegistry] = seconds_since(t0);
    return a;
}

std::shared_ptr<Allocation> Allocation::lookup(std::uint64_t id) {
    LiveTable& table = live_table();
    std::lock_guard<std::mutex> lock(table.mutex);
    auto it = table.by_id.find(id);
    return it == table.by_id.end() ? nullptr : it->second.allocation.lock();
}

bool Allocation::inherited() const { return generation_ != fork_generation(); }

void Allocation::prepare_fork() { live_table().mutex.lock(); }

void Allocation::after_fork_parent() { live_table().mutex.unlock(); }

void Allocation::after_fork_child() {
    // The fork rule (docs/native.md, "fork()"): in the child, no allocation made before the fork is pinned. The
    // kernel did not copy the page locks, and device registrations belong to the parent's device context, so
    // the child must neither report these buffers pinned nor undo the parent's locks or registrations. Each
    // one stays mapped (copy-on-write) for as long as a view of it lives, counted as unpinned-but-alive, and is
    // only unmapped when that last view dies. fork_generation() was already advanced, so inherited() is true
    // for all of them and none of their methods takes their own mutex again (a thread that held it is gone).
    LiveTable& table = live_table();
    std::vector<RangeEntry> owned;
    owned.reserve(table.by_id.size());
    std::int64_t alive = 0;
    for (auto it = table.by_id.begin(); it != table.by_id.end();) {
        owned.push_back(RangeEntry{it->second.start, 0, it->first});
        std::shared_ptr<Allocation> a = it->second.allocation.lock();
        // Published and still referenced: a tensor of the child may hold it; its deleter will run here.
        // Otherwise its creator or its destroyer was another thread, which did not survive the fork.
        if (a && a->published_) {
            ++alive;
            ++it;
        } else {
            it = table.by_id.erase(it);
        }
    }
    RangeRegistry::global().remove_owned_during_fork(owned);
    g_allocations.store(0);
    g_bytes.store(0);
    g_registered_bytes.store(0);
    g_unpinned_alive.store(alive);
    table.mutex.unlock();
}

void Allocation::release_pins_locked() {
    const bool was_pinned = pinned_.exchange(false, std::memory_order_acq_rel);
    if (in_registry_) {
        in_registry_ = false;
        RangeRegistry::global().remove(data());
    }
    bool unregister_failed = false;
    if (cuda_registered_) {
        cuda_registered_ = false;
        if (!CudaHostApi::host_unregister(data_).empty()) unregister_failed = true;
    }
    if (external_unregister_) {
        auto hook = std::move(external_unregister_);
        external_unregister_ = nullptr;
        hook(false);
    }
    const bool was_registered = registered_.exchange(false, std::memory_order_acq_rel);
    if (locked_len_ != 0) {
        if (munlock(data_, locked_len_) != 0) g_release_errors.fetch_add(1);
        locked_len_ = 0;
    }
    if (unregister_failed) g_release_errors.fetch_add(1);
    if (was_pinned) {
        g_allocations.fetch_sub(1);
        g_bytes.fetch_sub(static_cast<std::int64_t>(size_));
        if (was_registered) g_registered_bytes.fetch_sub(static_cast<std::int64_t>(size_));
    }
}

Allocation::UnpinResult Allocation::unpin() {
    if (inherited()) return UnpinResult::kNotPinned;  // the fork rule: not pinned in this process
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pinned_.load(std::memory_order_acquire)) return UnpinResult::kNotPinned;
    // The external hook runs first and alone: if it fails nothing else has changed (still pinned, registered,
    // in the registry and counted), so the caller sees the error and may retry (docs/native.md).
    if (external_unregister_) {
        if (!external_unregister_(true)) return UnpinResult::kHookFailed;
        external_unregister_ = nullptr;
    }
    release_pins_locked();
    g_unpinned_alive.fetch_add(1);
    return UnpinResult::kUnpinned;
}

void Allocation::set_external_registration(UnregisterHook unregister) {
    if (inherited()) return;  // the parent's registration: never undone from here (the hook is dropped uncalled)
    std::unique_lock<std::mutex> lock(mutex_);
    if (!pinned_.load(std::memory_order_acquire)) {
        lock.unlock();
        unregister(false);  // unpinned in the meantime: undo the registration right away
        return;
    }
    external_unregister_ = std::move(unregister);
    if (!registered_.exchange(true, std::memory_order_acq_rel)) {
        g_registered_bytes.fetch_add(static_cast<std::int64_t>(size_));
    }
}

Allocation::~Allocation() {
    if (inherited()) {
        // Made before a fork: the child handler already dropped its range and stopped counting it as pinned.
        // Nothing to unlock (locks are not inherited), nothing to unregister (the parent's), no hook to call.
        if (published_) g_unpinned_alive.fetch_sub(1);
        {
            LiveTable& table = live_table();
            std::lock_guard<std::mutex> tlock(table.mutex);
            table.by_id.erase(id_);
        }
        if (map_base_ != nullptr && munmap(map_base_, map_len_) != 0) g_release_errors.fetch_add(1);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        const bool was_unpinned = published_ && !pinned_.load(std::memory_order_acquire);
        // Also undoes a creation that failed part-way (lock held, registration done, never published).
        release_pins_locked();
        if (was_unpinned) g_unpinned_alive.fetch_sub(1);
        if (in_table_) {
            LiveTable& table = live_table();
            std::lock_guard<std::mutex> tlock(table.mutex);
            table.by_id.erase(id_);
        }
    }
    if (map_base_ != nullptr && munmap(map_base_, map_len_) != 0) g_release_errors.fetch_add(1);
}

}  // namespace hostoffload

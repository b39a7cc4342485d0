// Native pinned host allocations: page-aligned mapping, parallel population, page lock, device registration,
// and an entry in the process-wide range registry.
//
// Why native: the reference does the same steps from Python one page at a time (mmap + mlock faults every 4 KiB
// page in on one thread). Here the pages are faulted in by several threads at once, preferably as 2 MiB pages
// (transparent huge pages via madvise, or explicit hugetlbfs pages when asked), which cuts page-fault work by
// 512x and makes the device registration walk far fewer pages.
//
// Lifetime: an Allocation is owned by shared_ptrs held by exported DLPack tensors (and, briefly, by callers).
// unpin() drops the range, unregisters and unlocks at once but keeps the mapping; the destructor finishes
// whatever is left, in the fixed order range -> device -> munlock -> munmap. The destructor runs on whichever
// thread drops the last view, possibly during shutdown, so it touches no Python state unless an external
// (Python) unregister hook was installed, and then only while the interpreter is alive.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace hostoffload {

enum class HugePageMode { kOff, kAuto, kTransparent, kHugetlb };

struct AllocRequest {
    std::size_t nbytes = 0;
    HugePageMode huge_pages = HugePageMode::kAuto;
    int populate_threads = 0;  // 0: chosen from the size and the hardware
    bool register_cuda = false;
    unsigned cuda_flags = 0;
    bool overlap_register = false;  // start cudaHostRegister while population threads are still faulting
    bool slab = false;  // owner of sub-allocated pieces; unpin() of a piece must not unpin it
};

// mlock refused the pages (RLIMIT_MEMLOCK / ulimit -l). Everything was released before it is thrown.
class LockError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// The kernel could not provide the memory at all (mmap or population failed); everything was released.
class HostAllocError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

class Allocation {
public:
    ~Allocation();
    Allocation(const Allocation&) = delete;
    Allocation& operator=(const Allocation&) = delete;

    std::uint64_t id() const { return id_; }
    // True in a forked child for every allocation made before the fork (by this process's parent): such an
    // allocation is not pinned here (page locks and device registrations are not inherited; docs/native.md).
    bool inherited() const;
    std::uintptr_t data() const { return reinterpret_cast<std::uintptr_t>(data_); }
    std::size_t size() const { return size_; }  // page-rounded bytes, locked and registered as a whole
    bool is_slab() const { return slab_; }
    bool pinned() const { return pinned_.load(std::memory_order_acquire) && !inherited(); }
    bool registered() const { return registered_.load(std::memory_order_acquire) && !inherited(); }
    const char* page_kind() const { return page_kind_; }
    const std::string& register_error() const { return register_error_; }
    // Seconds spent in each phase of the allocation (map, populate, lock, register, registry).
    const double* phase_seconds() const { return phase_seconds_; }

    // What unpin() did: unpinned it now, found it already unpinned, or left it untouched because the external
    // unregister hook failed (the allocation stays pinned, registered and in the registry: the caller may retry).
    enum class UnpinResult { kUnpinned, kNotPinned, kHookFailed };

    // Unregister, drop the range, munlock now; the mapping stays until destruction.
    UnpinResult unpin();

    // An external unregister hook: called with may_fail=true from unpin() (returning false leaves everything as
    // it was; the hook keeps its error for the caller), with may_fail=false from the destructor (it must report
    // its own failure; the release goes on). Returns true once the registration is undone.
    using UnregisterHook = std::function<bool(bool may_fail)>;

    // Marks the allocation registered through an external hook (an accelerator that is not CUDA): `unregister`
    // runs before the pages are unlocked, from unpin() or the destructor, until it succeeds once.
    void set_external_registration(UnregisterHook unregister);

    static std::shared_ptr<Allocation> create(const AllocRequest& req);
    // The live allocation with this id, or nullptr (already destroyed or never existed).
    static std::shared_ptr<Allocation> lookup(std::uint64_t id);

    // pthread_atfork handlers (installed by fork_safety.cpp). prepare holds the live table's mutex across the
    // fork; the child handler applies the fork rule to every inherited allocation (its range leaves the global
    // registry, whose writer lock prepare already holds; the counters are recomputed) and releases it.
    static void prepare_fork();
    static void after_fork_parent();
    static void after_fork_child();

private:
    Allocation() = default;
    void release_pins_locked();

    std::uint64_t id_ = 0;
    std::uint64_t generation_ = 0;  // fork_generation() of the process that created it
    void* map_base_ = nullptr;
    std::size_t map_len_ = 0;
    void* data_ = nullptr;
    std::size_t size_ = 0;
    std::size_t locked_len_ = 0;
    bool slab_ = false;
    const char* page_kind_ = "4k";
    std::string register_error_;
    double phase_seconds_[5] = {0, 0, 0, 0, 0};
    bool cuda_registered_ = false;
    bool published_ = false;    // counted in the stats
    bool in_table_ = false;     // findable by id
    bool in_registry_ = false;  // its range is registered
    UnregisterHook external_unregister_;
    std::mutex mutex_;  // serialises unpin(), set_external_registration() and destruction
    std::atomic<bool> pinned_{false};
    std::atomic<bool> registered_{false};
};

struct PinnedCounters {
    std::int64_t allocations;
    std::int64_t bytes;
    std::int64_t registered_bytes;
    std::int64_t unpinned_alive;
    std::int64_t release_errors;  // failed munlock/munmap/unregister in destructors (nothing to raise into)
};

PinnedCounters pinned_counters();

std::size_t host_page_size();

}  // namespace hostoffload

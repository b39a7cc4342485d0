// Process-wide registry of pinned host byte ranges (optimized counterpart of reference/ranges.py).
//
// The rule is the reference's, bit for bit: an extent [ptr, ptr + nbytes) is pinned iff it lies entirely
// inside ONE registered range; a zero-length extent is pinned iff its address lies inside a range.
//
// Why this shape: lookups happen on every copy decision (is_pinned on a view), from many threads, while
// pin/unpin are comparatively rare. So readers never take a lock. The ranges live in an immutable two-level
// snapshot (a sorted array of chunk first-addresses pointing at small sorted chunks); a writer, under a
// mutex, copies only the chunk it changes plus the top-level arrays (O(n / chunk) words), publishes the new
// snapshot with one atomic pointer store, and retires the old objects. Retired objects are freed once every
// reader that could still see them has left its read section (epoch-based reclamation, see ReadSection).
// Lookups are two binary searches: O(log n).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hostoffload {

struct RangeEntry {
    std::uint64_t start;
    // Inclusive: the last byte of a range (nbytes >= 1). An exclusive end could not represent a range that ends
    // exactly at 2**64, which the contract (check_range_end) and the reference accept.
    std::uint64_t last;
    std::uint64_t owner;
};

// A range that overlaps a registered one. Carries the conflicting entry for the error message.
class RangeOverlapError : public std::runtime_error {
public:
    RangeOverlapError(const RangeEntry& wanted, const RangeEntry& existing);
};

class RangeRegistry {
public:
    RangeRegistry();
    ~RangeRegistry();
    RangeRegistry(const RangeRegistry&) = delete;
    RangeRegistry& operator=(const RangeRegistry&) = delete;

    // Writers (serialised on a mutex). add() throws RangeOverlapError and leaves the registry unchanged.
    // Callers guarantee nbytes >= 1 and start + nbytes does not wrap.
    void add(std::uint64_t start, std::uint64_t nbytes, std::uint64_t owner);
    // Adds many ranges with one snapshot rebuild (O((n + k) log k)); all or nothing.
    void add_many(std::vector<RangeEntry> entries);
    bool remove(std::uint64_t start);
    // Removes every range starting at one of `starts` with one rebuild; returns how many were removed.
    std::size_t remove_many(std::vector<std::uint64_t> starts);
    // Removes every range; returns how many there were.
    std::size_t clear();

    // Readers (lock-free, never block on writers).
    bool contains(std::uint64_t ptr, std::uint64_t nbytes) const;
    std::optional<RangeEntry> find(std::uint64_t ptr) const;
    std::vector<RangeEntry> ranges() const;
    std::size_t size() const;
    std::uint64_t total_bytes() const;

    // Number of retired snapshot objects not yet reclaimed (diagnostics and tests).
    std::size_t retired_pending() const;

    // ---- fork safety (driven by fork_safety.cpp's pthread_atfork handlers; see docs/native.md "fork()") ----
    // prepare: takes the instance list's mutex, then every live instance's writer mutex, so no writer is
    // half-way through a snapshot when the address space is copied. parent: releases them. child: the one
    // thread of the child releases them and forgets every reader slot of the threads that did not survive the
    // fork (a slot left "reading" would block reclamation forever).
    static void prepare_fork();
    static void after_fork_parent();
    static void after_fork_child();
    // Child handler only, while prepare_fork()'s locks are still held: drops every range whose (start, owner)
    // is in `owned` (the allocations the child inherited). Returns how many were dropped.
    std::size_t remove_owned_during_fork(const std::vector<RangeEntry>& owned);

    // The one process-wide instance. Deliberately never destroyed: DLPack deleters may run during interpreter
    // or process shutdown, after static destructors, and must still be able to drop their range.
    static RangeRegistry& global();

    struct Chunk;
    struct Snapshot;

private:
    struct Retired;

    void publish_locked(Snapshot* next, std::vector<const Chunk*> dead_chunks);
    void reclaim_locked();
    template <class F>
    auto read(F&& f) const;
    std::size_t remove_many_locked(std::vector<std::uint64_t> starts);

    std::atomic<Snapshot*> current_;
    mutable std::mutex writer_mutex_;
    std::vector<Retired> retired_;
};

}  // namespace hostoffload

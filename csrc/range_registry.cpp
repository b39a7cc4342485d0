// Lock-free-read range registry; see range_registry.h for the design and the rule it implements.
#include "range_registry.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <memory>
#include <utility>

namespace hostoffload {

namespace {

// A chunk holds at most this many ranges. Small enough that a writer's copy is a few KiB, large enough that
// the top-level arrays stay ~n/256 entries (1M ranges: a ~64 KiB copy per write).
constexpr std::size_t kChunkMax = 512;
// Chunks built in bulk are half full so the next inserts do not split at once.
constexpr std::size_t kChunkBulk = kChunkMax / 2;

// ---- epoch-based reclamation -------------------------------------------------------------------------
// A reader announces the global epoch in its own cache line before it loads the snapshot pointer and clears
// it afterwards. A writer swaps the pointer, then advances the epoch; the value it advanced FROM tags the
// retired objects. Every operation is seq_cst, so a reader that loaded the old pointer announced before the
// swap, i.e. an epoch <= that tag, and a reader that announced later can only have seen the new pointer.
// Retired objects are therefore freed once no announced epoch is <= their tag.
constexpr std::size_t kReaderSlots = 512;

struct alignas(64) ReaderSlot {
    std::atomic<std::uint64_t> active{0};  // 0: not reading
    std::atomic<bool> claimed{false};
};

ReaderSlot* reader_slots() {
    // Immortal: thread-exit handlers of late threads may still release their slot during shutdown.
    static ReaderSlot* slots = new ReaderSlot[kReaderSlots];
    return slots;
}

std::atomic<std::uint64_t> g_epoch{1};
// Readers that found no free slot (more than kReaderSlots threads reading at once). While any is inside a
// read section, nothing is reclaimed: correct, just conservative.
std::atomic<std::uint64_t> g_overflow_readers{0};

struct ThreadSlot {
    ReaderSlot* slot = nullptr;
    bool tried = false;
    ~ThreadSlot() {
        if (slot != nullptr) {
            slot->active.store(0, std::memory_order_seq_cst);
            slot->claimed.store(false, std::memory_order_release);
        }
    }
};

thread_local ThreadSlot t_slot;

ReaderSlot* this_thread_slot() {
    if (!t_slot.tried) {
        t_slot.tried = true;
        ReaderSlot* slots = reader_slots();
        for (std::size_t i = 0; i < kReaderSlots; ++i) {
            bool expected = false;
            if (!slots[i].claimed.load(std::memory_order_relaxed) &&
                slots[i].claimed.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
                t_slot.slot = &slots[i];
                break;
            }
        }
    }
    return t_slot.slot;
}

class ReadGuard {
public:
    ReadGuard() : slot_(this_thread_slot()) {
        if (slot_ != nullptr) {
            slot_->active.store(g_epoch.load(std::memory_order_seq_cst), std::memory_order_seq_cst);
        } else {
            g_overflow_readers.fetch_add(1, std::memory_order_seq_cst);
        }
    }
    ~ReadGuard() {
        if (slot_ != nullptr) {
            slot_->active.store(0, std::memory_order_release);
        } else {
            g_overflow_readers.fetch_sub(1, std::memory_order_release);
        }
    }
    ReadGuard(const ReadGuard&) = delete;
    ReadGuard& operator=(const ReadGuard&) = delete;

private:
    ReaderSlot* slot_;
};

std::string describe(const RangeEntry& e) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "[%#" PRIx64 ", +%" PRIu64 ")", e.start, e.last - e.start + 1);
    return buf;
}

bool start_less(const RangeEntry& a, const RangeEntry& b) { return a.start < b.start; }

}  // namespace

RangeOverlapError::RangeOverlapError(const RangeEntry& wanted, const RangeEntry& existing)
    : std::runtime_error("range " + describe(wanted) + " overlaps registered range " + describe(existing)) {}

struct RangeRegistry::Chunk {
    std::vector<RangeEntry> entries;  // sorted by start, non-overlapping, never empty once published
};

struct RangeRegistry::Snapshot {
    std::vector<std::uint64_t> firsts;  // firsts[i] == chunks[i]->entries.front().start
    std::vector<const Chunk*> chunks;
    std::size_t count = 0;
    std::uint64_t total = 0;

    // Index of the chunk whose first start is <= ptr, or -1.
    std::ptrdiff_t chunk_for(std::uint64_t ptr) const {
        auto it = std::upper_bound(firsts.begin(), firsts.end(), ptr);
        return (it - firsts.begin()) - 1;
    }

    // The entry with the largest start <= ptr, or nullptr.
    const RangeEntry* floor_entry(std::uint64_t ptr) const {
        const std::ptrdiff_t ci = chunk_for(ptr);
        if (ci < 0) return nullptr;
        const auto& es = chunks[static_cast<std::size_t>(ci)]->entries;
        auto it = std::upper_bound(es.begin(), es.end(), ptr,
                                   [](std::uint64_t p, const RangeEntry& e) { return p < e.start; });
        return &*(it - 1);  // es.front().start <= ptr, so it > begin
    }
};

struct RangeRegistry::Retired {
    std::uint64_t tag;
    const Snapshot* snapshot;
    std::vector<const Chunk*> chunks;
};

// Every live instance, so the fork handlers can hold each writer mutex across fork(). Immortal, like the global
// instance; guarded by its own mutex, which is never taken while a writer mutex is held (constructors and
// destructors take only this one), so prepare_fork's order (list, then writers) cannot deadlock.
struct InstanceList {
    std::mutex mutex;
    std::vector<RangeRegistry*> live;
};

InstanceList& instances() {
    static InstanceList* list = new InstanceList();
    return *list;
}

RangeRegistry::RangeRegistry() : current_(new Snapshot()) {
    InstanceList& list = instances();
    std::lock_guard<std::mutex> lock(list.mutex);
    list.live.push_back(this);
}

RangeRegistry::~RangeRegistry() {
    {
        InstanceList& list = instances();
        std::lock_guard<std::mutex> lock(list.mutex);
        list.live.erase(std::remove(list.live.begin(), list.live.end(), this), list.live.end());
    }
    // Only private instances are ever destroyed, and only once nothing can read them any more.
    Snapshot* cur = current_.load(std::memory_order_acquire);
    for (const Chunk* c : cur->chunks) delete c;
    delete cur;
    for (Retired& r : retired_) {
        for (const Chunk* c : r.chunks) delete c;
        delete r.snapshot;
    }
}

RangeRegistry& RangeRegistry::global() {
    static RangeRegistry* instance = new RangeRegistry();
    return *instance;
}

template <class F>
auto RangeRegistry::read(F&& f) const {
    ReadGuard guard;
    const Snapshot* snap = current_.load(std::memory_order_seq_cst);
    return f(*snap);
}

void RangeRegistry::publish_locked(Snapshot* next, std::vector<const Chunk*> dead_chunks) {
    Snapshot* old = current_.exchange(next, std::memory_order_seq_cst);
    const std::uint64_t tag = g_epoch.fetch_add(1, std::memory_order_seq_cst);
    retired_.push_back(Retired{tag, old, std::move(dead_chunks)});
    reclaim_locked();
}

void RangeRegistry::reclaim_locked() {
    if (retired_.empty() || g_overflow_readers.load(std::memory_order_seq_cst) != 0) return;
    std::uint64_t oldest_reader = std::numeric_limits<std::uint64_t>::max();
    ReaderSlot* slots = reader_slots();
    for (std::size_t i = 0; i < kReaderSlots; ++i) {
        const std::uint64_t a = slots[i].active.load(std::memory_order_seq_cst);
        if (a != 0 && a < oldest_reader) oldest_reader = a;
    }
    auto keep = std::partition(retired_.begin(), retired_.end(),
                               [&](const Retired& r) { return r.tag >= oldest_reader; });
    for (auto it = keep; it != retired_.end(); ++it) {
        for (const Chunk* c : it->chunks) delete c;
        delete it->snapshot;
    }
    retired_.erase(keep, retired_.end());
}

void RangeRegistry::add(std::uint64_t start, std::uint64_t nbytes, std::uint64_t owner) {
    const RangeEntry e{start, start + (nbytes - 1), owner};  // nbytes >= 1, start + nbytes <= 2**64
    std::lock_guard<std::mutex> lock(writer_mutex_);
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);

    // Same order of checks as the reference: the predecessor (start <= e.start), then the successor.
    std::ptrdiff_t ci = cur.chunk_for(start);
    if (ci >= 0) {
        const RangeEntry* prev = cur.floor_entry(start);
        if (prev->last >= start) throw RangeOverlapError(e, *prev);
    }
    const std::size_t target = ci < 0 ? 0 : static_cast<std::size_t>(ci);
    if (!cur.chunks.empty()) {
        const auto& es = cur.chunks[target]->entries;
        auto pos = std::upper_bound(es.begin(), es.end(), e, start_less);
        const RangeEntry* next = nullptr;
        if (pos != es.end()) {
            next = &*pos;
        } else if (target + 1 < cur.chunks.size()) {
            next = &cur.chunks[target + 1]->entries.front();
        }
        if (next != nullptr && next->start <= e.last) throw RangeOverlapError(e, *next);
    }

    // New chunks are owned by unique_ptrs until the snapshot is published, so an allocation failure
    // anywhere below leaves the registry untouched and leaks nothing.
    std::vector<std::unique_ptr<Chunk>> fresh;
    std::unique_ptr<Snapshot> snap(new Snapshot());
    std::vector<const Chunk*> dead;
    snap->count = cur.count + 1;
    snap->total = cur.total + nbytes;
    const auto t = static_cast<std::ptrdiff_t>(target);
    if (cur.chunks.empty()) {
        fresh.emplace_back(new Chunk{{e}});
    } else {
        const Chunk* old_chunk = cur.chunks[target];
        std::vector<RangeEntry> es = old_chunk->entries;
        es.insert(std::upper_bound(es.begin(), es.end(), e, start_less), e);
        if (es.size() > kChunkMax) {
            const auto mid = es.begin() + static_cast<std::ptrdiff_t>(es.size() / 2);
            fresh.emplace_back(new Chunk{std::vector<RangeEntry>(es.begin(), mid)});
            fresh.emplace_back(new Chunk{std::vector<RangeEntry>(mid, es.end())});
        } else {
            fresh.emplace_back(new Chunk{std::move(es)});
        }
        dead.push_back(old_chunk);
    }
    const std::size_t replaced = cur.chunks.empty() ? 0 : 1;
    snap->chunks.reserve(cur.chunks.size() + fresh.size() - replaced);
    snap->firsts.reserve(cur.chunks.size() + fresh.size() - replaced);
    snap->chunks.assign(cur.chunks.begin(), cur.chunks.begin() + t);
    snap->firsts.assign(cur.firsts.begin(), cur.firsts.begin() + t);
    for (const auto& c : fresh) {
        snap->chunks.push_back(c.get());
        snap->firsts.push_back(c->entries.front().start);
    }
    if (replaced != 0) {
        snap->chunks.insert(snap->chunks.end(), cur.chunks.begin() + t + 1, cur.chunks.end());
        snap->firsts.insert(snap->firsts.end(), cur.firsts.begin() + t + 1, cur.firsts.end());
    }
    for (auto& c : fresh) c.release();
    publish_locked(snap.release(), std::move(dead));
}

void RangeRegistry::add_many(std::vector<RangeEntry> entries) {
    if (entries.empty()) return;
    std::sort(entries.begin(), entries.end(), start_less);
    for (std::size_t i = 1; i < entries.size(); ++i) {
        if (entries[i - 1].last >= entries[i].start) throw RangeOverlapError(entries[i], entries[i - 1]);
    }
    std::lock_guard<std::mutex> lock(writer_mutex_);
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);
    for (const RangeEntry& e : entries) {
        if (const RangeEntry* prev = cur.floor_entry(e.start); prev != nullptr && prev->last >= e.start) {
            throw RangeOverlapError(e, *prev);
        }
        if (const RangeEntry* next = cur.floor_entry(e.last); next != nullptr && next->start > e.start) {
            throw RangeOverlapError(e, *next);
        }
    }
    std::vector<RangeEntry> all;
    all.reserve(cur.count + entries.size());
    for (const Chunk* c : cur.chunks) all.insert(all.end(), c->entries.begin(), c->entries.end());
    const auto old_end = static_cast<std::ptrdiff_t>(all.size());
    all.insert(all.end(), entries.begin(), entries.end());
    std::inplace_merge(all.begin(), all.begin() + old_end, all.end(), start_less);
    std::unique_ptr<Snapshot> snap(new Snapshot());
    std::vector<std::unique_ptr<Chunk>> built;
    for (std::size_t i = 0; i < all.size(); i += kChunkBulk) {
        const std::size_t end = std::min(all.size(), i + kChunkBulk);
        built.emplace_back(new Chunk{std::vector<RangeEntry>(all.begin() + static_cast<std::ptrdiff_t>(i),
                                                             all.begin() + static_cast<std::ptrdiff_t>(end))});
        snap->firsts.push_back(all[i].start);
    }
    snap->count = all.size();
    snap->total = cur.total;
    for (const RangeEntry& e : entries) snap->total += e.last - e.start + 1;
    std::vector<const Chunk*> dead(cur.chunks.begin(), cur.chunks.end());
    snap->chunks.reserve(built.size());
    for (auto& c : built) snap->chunks.push_back(c.release());
    publish_locked(snap.release(), std::move(dead));
}

bool RangeRegistry::remove(std::uint64_t start) {
    std::lock_guard<std::mutex> lock(writer_mutex_);
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);
    const std::ptrdiff_t ci = cur.chunk_for(start);
    if (ci < 0) return false;
    const auto idx = static_cast<std::size_t>(ci);
    const Chunk* old_chunk = cur.chunks[idx];
    const auto& es = old_chunk->entries;
    auto pos = std::lower_bound(es.begin(), es.end(), RangeEntry{start, 0, 0}, start_less);
    if (pos == es.end() || pos->start != start) return false;

    std::unique_ptr<Snapshot> snap(new Snapshot());
    snap->count = cur.count - 1;
    snap->total = cur.total - (pos->last - pos->start + 1);
    snap->chunks = cur.chunks;
    snap->firsts = cur.firsts;
    if (es.size() == 1) {
        snap->chunks.erase(snap->chunks.begin() + ci);
        snap->firsts.erase(snap->firsts.begin() + ci);
    } else {
        std::vector<RangeEntry> rest;
        rest.reserve(es.size() - 1);
        rest.insert(rest.end(), es.begin(), pos);
        rest.insert(rest.end(), pos + 1, es.end());
        auto* c = new Chunk{std::move(rest)};
        snap->chunks[idx] = c;
        snap->firsts[idx] = c->entries.front().start;
    }
    publish_locked(snap.release(), {old_chunk});
    return true;
}

std::size_t RangeRegistry::remove_many(std::vector<std::uint64_t> starts) {
    std::lock_guard<std::mutex> lock(writer_mutex_);
    return remove_many_locked(std::move(starts));
}

std::size_t RangeRegistry::remove_many_locked(std::vector<std::uint64_t> starts) {
    std::sort(starts.begin(), starts.end());
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);
    std::vector<RangeEntry> kept;
    kept.reserve(cur.count);
    std::uint64_t total = 0;
    for (const Chunk* c : cur.chunks) {
        for (const RangeEntry& e : c->entries) {
            if (!std::binary_search(starts.begin(), starts.end(), e.start)) {
                kept.push_back(e);
                total += e.last - e.start + 1;
            }
        }
    }
    const std::size_t removed = cur.count - kept.size();
    if (removed == 0) return 0;
    std::unique_ptr<Snapshot> snap(new Snapshot());
    std::vector<std::unique_ptr<Chunk>> built;
    for (std::size_t i = 0; i < kept.size(); i += kChunkBulk) {
        const std::size_t end = std::min(kept.size(), i + kChunkBulk);
        built.emplace_back(new Chunk{std::vector<RangeEntry>(kept.begin() + static_cast<std::ptrdiff_t>(i),
                                                             kept.begin() + static_cast<std::ptrdiff_t>(end))});
        snap->firsts.push_back(kept[i].start);
    }
    snap->count = kept.size();
    snap->total = total;
    std::vector<const Chunk*> dead(cur.chunks.begin(), cur.chunks.end());
    snap->chunks.reserve(built.size());
    for (auto& c : built) snap->chunks.push_back(c.release());
    publish_locked(snap.release(), std::move(dead));
    return removed;
}

std::size_t RangeRegistry::clear() {
    std::lock_guard<std::mutex> lock(writer_mutex_);
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);
    const std::size_t n = cur.count;
    std::vector<const Chunk*> dead(cur.chunks.begin(), cur.chunks.end());
    publish_locked(new Snapshot(), std::move(dead));
    return n;
}

bool RangeRegistry::contains(std::uint64_t ptr, std::uint64_t nbytes) const {
    return read([&](const Snapshot& s) {
        const RangeEntry* e = s.floor_entry(ptr);
        // ptr <= last, and the extent's end (ptr + nbytes) <= last + 1 without overflowing: a zero-length extent
        // needs only its address inside; otherwise its last byte, ptr + nbytes - 1, must be <= last.
        return e != nullptr && ptr <= e->last && (nbytes == 0 || nbytes - 1 <= e->last - ptr);
    });
}

std::optional<RangeEntry> RangeRegistry::find(std::uint64_t ptr) const {
    return read([&](const Snapshot& s) -> std::optional<RangeEntry> {
        const RangeEntry* e = s.floor_entry(ptr);
        if (e != nullptr && ptr <= e->last) return *e;
        return std::nullopt;
    });
}

std::vector<RangeEntry> RangeRegistry::ranges() const {
    return read([](const Snapshot& s) {
        std::vector<RangeEntry> out;
        out.reserve(s.count);
        for (const Chunk* c : s.chunks) out.insert(out.end(), c->entries.begin(), c->entries.end());
        return out;
    });
}

std::size_t RangeRegistry::size() const {
    return read([](const Snapshot& s) { return s.count; });
}

std::uint64_t RangeRegistry::total_bytes() const {
    return read([](const Snapshot& s) { return s.total; });
}

std::size_t RangeRegistry::retired_pending() const {
    std::lock_guard<std::mutex> lock(writer_mutex_);
    return retired_.size();
}

// ---- fork safety ------------------------------------------------------------------------------------------------

void RangeRegistry::prepare_fork() {
    InstanceList& list = instances();
    list.mutex.lock();
    for (RangeRegistry* r : list.live) r->writer_mutex_.lock();
}

void RangeRegistry::after_fork_parent() {
    InstanceList& list = instances();
    for (auto it = list.live.rbegin(); it != list.live.rend(); ++it) (*it)->writer_mutex_.unlock();
    list.mutex.unlock();
}

void RangeRegistry::after_fork_child() {
    // Only the forking thread exists now, and it is not inside a read section (fork() is never called from one),
    // so every reader slot but its own belongs to a thread that is gone, and no overflow reader is left.
    ReaderSlot* own = t_slot.slot;
    ReaderSlot* slots = reader_slots();
    for (std::size_t i = 0; i < kReaderSlots; ++i) {
        if (&slots[i] == own) continue;
        slots[i].active.store(0, std::memory_order_relaxed);
        slots[i].claimed.store(false, std::memory_order_relaxed);
    }
    if (own != nullptr) own->active.store(0, std::memory_order_relaxed);
    g_overflow_readers.store(0, std::memory_order_relaxed);
    InstanceList& list = instances();
    for (auto it = list.live.rbegin(); it != list.live.rend(); ++it) {
        (*it)->reclaim_locked();  // what the vanished readers held back can go now
        (*it)->writer_mutex_.unlock();
    }
    list.mutex.unlock();
}

std::size_t RangeRegistry::remove_owned_during_fork(const std::vector<RangeEntry>& owned) {
    // writer_mutex_ is held by prepare_fork().
    std::vector<std::uint64_t> starts;
    starts.reserve(owned.size());
    const Snapshot& cur = *current_.load(std::memory_order_relaxed);
    for (const RangeEntry& o : owned) {
        const RangeEntry* e = cur.floor_entry(o.start);
        if (e != nullptr && e->start == o.start && e->owner == o.owner) starts.push_back(o.start);
    }
    return starts.empty() ? 0 : remove_many_locked(std::move(starts));
}

}  // namespace hostoffload

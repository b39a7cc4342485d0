// First-fit offset allocator for pinned slabs; see slab_arena.h.
#include "slab_arena.h"

#include <algorithm>
#include <string>

namespace hostoffload {

SlabArena::SlabArena(std::size_t capacity) : capacity_(capacity) {
    if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<std::size_t> SlabArena::allocate(std::size_t nbytes, std::size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
        throw std::invalid_argument("alignment must be a power of two >= 1, got " + std::to_string(alignment));
    }
    const std::size_t span = std::max<std::size_t>(nbytes, 1);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        const std::size_t start = it->first;
        const std::size_t len = it->second;
        const std::size_t aligned = (start + alignment - 1) & ~(alignment - 1);
        if (aligned < start || aligned - start > len || len - (aligned - start) < span) continue;
        const std::size_t end = aligned + span;
        const std::size_t run_end = start + len;
        free_.erase(it);
        if (aligned > start) free_.emplace(start, aligned - start);
        if (run_end > end) free_.emplace(end, run_end - end);
        pieces_.emplace(aligned, Piece{span, nbytes});
        used_ += nbytes;
        spanned_ += span;
        return aligned;
    }
    return std::nullopt;
}

bool SlabArena::release(std::size_t offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto p = pieces_.find(offset);
    if (p == pieces_.end()) return false;
    std::size_t start = offset;
    std::size_t len = p->second.span;
    used_ -= p->second.requested;
    spanned_ -= p->second.span;
    pieces_.erase(p);
    // Coalesce with the free run after, then the one before.
    auto next = free_.lower_bound(start);
    if (next != free_.end() && next->first == start + len) {
        len += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == start) {
            start = prev->first;
            len += prev->second;
            free_.erase(prev);
        }
    }
    free_.emplace(start, len);
    return true;
}

std::optional<std::size_t> SlabArena::piece_size(std::size_t offset) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto p = pieces_.find(offset);
    if (p == pieces_.end()) return std::nullopt;
    return p->second.requested;
}

SlabStats SlabArena::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t largest = 0;
    for (const auto& f : free_) largest = std::max(largest, f.second);
    return SlabStats{capacity_, used_, capacity_ - spanned_, largest, pieces_.size(), free_.size()};
}

void SlabArena::reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    pieces_.clear();
    free_.clear();
    if (capacity_ > 0) free_.emplace(0, capacity_);
    used_ = 0;
    spanned_ = 0;
}

}  // namespace hostoffload

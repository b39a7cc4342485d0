// Offset allocator behind optimized.slab.PinnedSlab: carves pieces out of one large pinned allocation.
//
// Why: registering memory with the device costs far more than a malloc (tens of microseconds to milliseconds
// per call, and the driver's registration table grows), so users that need many short-lived pinned buffers
// (activation offload pools, ZeRO gradient/optimizer-state buffers) register ONE slab and sub-allocate. The
// slab's single registry range makes every piece recognised by is_pinned.
//
// Policy: address-ordered first fit with immediate coalescing of neighbouring free blocks. It keeps pieces
// packed at low offsets, is O(free blocks) per allocation, and is predictable, which matters more here than
// the last percent of packing. Thread-safe (one mutex; pieces are coarse-grained).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>

namespace hostoffload {

struct SlabStats {
    std::size_t capacity;
    std::size_t used;           // bytes in live pieces (requested sizes, padding excluded)
    std::size_t free;           // capacity minus bytes held by live pieces (their spans)
    std::size_t largest_free;   // the longest free run
    std::size_t pieces;
    std::size_t free_blocks;    // fragmentation indicator
};

class SlabArena {
public:
    explicit SlabArena(std::size_t capacity);

    // Offset of a new piece of `nbytes` (>= 0; 0 still gets a distinct 1-byte span) aligned to `alignment`
    // (a power of two), or nullopt if no free run fits. Throws std::invalid_argument on a bad alignment.
    std::optional<std::size_t> allocate(std::size_t nbytes, std::size_t alignment);
    // Frees the piece starting at `offset`; false if no live piece starts there (double free, foreign ptr).
    bool release(std::size_t offset);
    // Requested size of the live piece at `offset`, if any.
    std::optional<std::size_t> piece_size(std::size_t offset) const;
    SlabStats stats() const;
    void reset();  // frees every piece

private:
    struct Piece {
        std::size_t span;       // bytes taken from the free list (>= 1)
        std::size_t requested;  // bytes the caller asked for
    };
    std::size_t capacity_;
    mutable std::mutex mutex_;
    std::map<std::size_t, std::size_t> free_;  // offset -> length, no two adjacent
    std::map<std::size_t, Piece> pieces_;      // offset -> piece
    std::size_t used_ = 0;
    std::size_t spanned_ = 0;
};

}  // namespace hostoffload

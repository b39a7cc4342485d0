// A native multi-threaded stress run of RangeRegistry (exposed to Python as optimized.ranges.stress_registry).
//
// Why native: from Python every registry call holds the GIL, so readers and writers never truly overlap and the
// lock-free read path (snapshot publication, epoch reclamation) would go untested. Here reader threads probe
// while writer threads add and remove, with no GIL in sight.
#pragma once

#include <cstdint>
#include <string>

namespace hostoffload {

struct StressResult {
    std::uint64_t reads = 0;
    std::uint64_t writes = 0;
    std::uint64_t violations = 0;  // a probe whose answer no interleaving allows
    std::string first_violation;
    std::uint64_t final_ranges = 0;
    std::uint64_t retired_pending = 0;
};

// `readers` threads probe ranges that stay registered throughout (must always be found, whole-extent rule
// included) and addresses never registered (must never be found); `writers` threads each add and remove
// `ops_per_writer` ranges of their own, checking after each step that their own ranges read back exactly.
// Runs on a private registry; afterwards only the stable ranges must remain.
StressResult stress_registry(int readers, int writers, int ops_per_writer);

}  // namespace hostoffload

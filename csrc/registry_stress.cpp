// Native stress run of the range registry; see registry_stress.h.
#include "registry_stress.h"

#include <atomic>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "range_registry.h"

namespace hostoffload {

namespace {

constexpr std::uint64_t kStableBase = std::uint64_t{1} << 40;
constexpr std::uint64_t kStableCount = 1000;
constexpr std::uint64_t kStableStride = 1 << 16;
constexpr std::uint64_t kStableSize = 1 << 12;
constexpr std::uint64_t kWriterBase = std::uint64_t{1} << 44;
constexpr std::uint64_t kWriterSpan = std::uint64_t{1} << 36;  // each writer owns a disjoint address window

}  // namespace

StressResult stress_registry(int readers, int writers, int ops_per_writer) {
    RangeRegistry reg;
    for (std::uint64_t i = 0; i < kStableCount; ++i) reg.add(kStableBase + i * kStableStride, kStableSize, i + 1);

    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> reads{0};
    std::atomic<std::uint64_t> writes{0};
    std::atomic<std::uint64_t> violations{0};
    std::mutex first_mutex;
    std::string first;
    auto violate = [&](const std::string& what) {
        if (violations.fetch_add(1) == 0) {
            std::lock_guard<std::mutex> lock(first_mutex);
            first = what;
        }
    };

    std::vector<std::thread> threads;
    for (int r = 0; r < readers; ++r) {
        threads.emplace_back([&, r] {
            std::mt19937_64 rng(static_cast<std::uint64_t>(r) * 7919 + 1);
            std::uint64_t n = 0;
            while (!stop.load(std::memory_order_relaxed) || n < 1000) {
                const std::uint64_t i = rng() % kStableCount;
                const std::uint64_t start = kStableBase + i * kStableStride;
                const std::uint64_t off = rng() % kStableSize;
                if (!reg.contains(start + off, kStableSize - off)) violate("a stable range was not found");
                if (reg.contains(start + off, kStableSize - off + 1)) violate("an extent past a range was found");
                if (reg.contains(start + kStableSize + off, 0)) violate("a gap between stable ranges was found");
                auto e = reg.find(start + off);
                if (!e || e->start != start || e->owner != i + 1) violate("find returned the wrong stable range");
                ++n;
            }
            reads.fetch_add(n * 4);
        });
    }
    for (int w = 0; w < writers; ++w) {
        threads.emplace_back([&, w] {
            std::mt19937_64 rng(static_cast<std::uint64_t>(w) * 104729 + 3);
            const std::uint64_t base = kWriterBase + static_cast<std::uint64_t>(w) * kWriterSpan;
            std::vector<std::uint64_t> mine;
            for (int op = 0; op < ops_per_writer; ++op) {
                if (!mine.empty() && (rng() % 2 == 0 || mine.size() > 64)) {
                    const std::size_t k = rng() % mine.size();
                    if (!reg.remove(mine[k])) violate("a writer could not remove its own range");
                    if (reg.contains(mine[k], 1)) violate("a removed range is still found");
                    mine[k] = mine.back();
                    mine.pop_back();
                } else {
                    const std::uint64_t start = base + (rng() % (kWriterSpan / 8192)) * 8192;
                    bool taken = false;
                    for (std::uint64_t s : mine) taken = taken || s == start;
                    if (taken) continue;
                    reg.add(start, 4096, static_cast<std::uint64_t>(w));
                    mine.push_back(start);
                    if (!reg.contains(start, 4096)) violate("a writer's new range is not found");
                }
                writes.fetch_add(1);
            }
            for (std::uint64_t s : mine) reg.remove(s);
        });
    }
    for (int i = readers; i < readers + writers; ++i) threads[static_cast<std::size_t>(i)].join();
    stop.store(true);
    for (int i = 0; i < readers; ++i) threads[static_cast<std::size_t>(i)].join();

    StressResult out;
    out.reads = reads.load();
    out.writes = writes.load();
    out.violations = violations.load();
    out.first_violation = first;
    out.final_ranges = reg.size();
    out.retired_pending = reg.retired_pending();
    if (out.final_ranges != kStableCount) {
        ++out.violations;
        if (out.first_violation.empty()) out.first_violation = "ranges left behind after every writer finished";
    }
    return out;
}

}  // namespace hostoffload

// pthread_atfork handlers for the registry and the allocator; see fork_safety.h.
#include "fork_safety.h"

#include <pthread.h>

#include <atomic>
#include <mutex>

#include "host_allocator.h"
#include "range_registry.h"

namespace hostoffload {

namespace {

std::atomic<std::uint64_t> g_generation{0};

// Lock order, the same everywhere: the registries (instance list, then each writer), then the live table. No
// other code path holds one of these and then waits for another of them, nor waits for the GIL while holding
// one, so a fork from a Python thread (which holds the GIL) cannot deadlock here.
void prepare() {
    RangeRegistry::prepare_fork();
    Allocation::prepare_fork();
}

void parent() {
    Allocation::after_fork_parent();
    RangeRegistry::after_fork_parent();
}

void child() {
    g_generation.fetch_add(1, std::memory_order_seq_cst);
    Allocation::after_fork_child();    // needs the global registry's writer lock, still held
    RangeRegistry::after_fork_child();  // releases the registry locks last
}

}  // namespace

std::uint64_t fork_generation() { return g_generation.load(std::memory_order_acquire); }

int install_fork_handlers() {
    static std::once_flag once;
    static int result = 0;
    std::call_once(once, [] {
        // Created now, not lazily inside a handler: constructing the global registry takes the instance-list
        // mutex, which the child handler already holds.
        RangeRegistry::global();
        result = pthread_atfork(prepare, parent, child);
    });
    return result;
}

}  // namespace hostoffload

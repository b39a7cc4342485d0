// Hands a native Allocation to Python as a DLPack capsule (a flat uint8 CPU tensor of the whole allocation).
//
// Why DLPack: torch adopts the memory without copying and calls our deleter when the last storage referencing it
// dies, so the allocation's lifetime is exactly the tensor storage's lifetime with no Python object in between
// (no finaliser ordering, no GC involvement). The deleter only drops a C++ shared_ptr; it needs no GIL and is
// safe on any thread and during interpreter shutdown.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "host_allocator.h"

namespace hostoffload {

// A "dltensor" capsule viewing [alloc.data(), alloc.data() + alloc.size()) as uint8[size].
pybind11::capsule export_dlpack(std::shared_ptr<Allocation> alloc);

// Number of exported DLPack tensors whose deleter has not run yet (diagnostics and leak tests).
long long dlpack_exports_alive();

}  // namespace hostoffload

// DLPack export of native allocations; see dlpack_export.h.
//
// The structs below follow the DLPack ABI (version 0.x, "dltensor" capsules), which every torch since 1.10
// consumes. Only what a flat CPU byte tensor needs is declared.
#include "dlpack_export.h"

#include <atomic>
#include <cstdint>
#include <utility>

namespace hostoffload {

namespace {

struct DLDevice {
    std::int32_t device_type;  // kDLCPU == 1
    std::int32_t device_id;
};

struct DLDataType {
    std::uint8_t code;  // kDLUInt == 1
    std::uint8_t bits;
    std::uint16_t lanes;
};

struct DLTensor {
    void* data;
    DLDevice device;
    std::int32_t ndim;
    DLDataType dtype;
    std::int64_t* shape;
    std::int64_t* strides;  // nullptr: compact row-major
    std::uint64_t byte_offset;
};

struct DLManagedTensor {
    DLTensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(DLManagedTensor* self);
};

constexpr std::int32_t kDLCPU = 1;
constexpr std::uint8_t kDLUInt = 1;
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

std::atomic<long long> g_exports_alive{0};

// One export: the managed tensor, the storage for its shape, and the reference that keeps the memory alive.
struct Export {
    DLManagedTensor managed{};
    std::int64_t shape[1] = {0};
    std::shared_ptr<Allocation> alloc;
};

void delete_export(DLManagedTensor* self) {
    // May run on any thread, with or without the GIL, during shutdown too: touches C++ state only.
    delete static_cast<Export*>(self->manager_ctx);
    g_exports_alive.fetch_sub(1, std::memory_order_relaxed);
}

// Capsule destructor: a consumer renames the capsule to "used_dltensor" and takes over the deleter; if nobody
// consumed it, the capsule still owns the export and must release it.
void capsule_destructor(PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, kUsedCapsuleName)) return;
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
    if (managed == nullptr) {
        PyErr_Clear();  // a destructor must not leave an exception set
        return;
    }
    managed->deleter(managed);
}

}  // namespace

pybind11::capsule export_dlpack(std::shared_ptr<Allocation> alloc) {
    auto* ex = new Export();
    ex->shape[0] = static_cast<std::int64_t>(alloc->size());
    ex->managed.dl_tensor.data = reinterpret_cast<void*>(alloc->data());
    ex->managed.dl_tensor.device = DLDevice{kDLCPU, 0};
    ex->managed.dl_tensor.ndim = 1;
    ex->managed.dl_tensor.dtype = DLDataType{kDLUInt, 8, 1};
    ex->managed.dl_tensor.shape = ex->shape;
    ex->managed.dl_tensor.strides = nullptr;
    ex->managed.dl_tensor.byte_offset = 0;
    ex->managed.manager_ctx = ex;
    ex->managed.deleter = delete_export;
    ex->alloc = std::move(alloc);
    g_exports_alive.fetch_add(1, std::memory_order_relaxed);
    PyObject* cap = PyCapsule_New(&ex->managed, kCapsuleName, capsule_destructor);
    if (cap == nullptr) {
        delete_export(&ex->managed);
        throw pybind11::error_already_set();
    }
    return pybind11::reinterpret_steal<pybind11::capsule>(cap);
}

long long dlpack_exports_alive() { return g_exports_alive.load(std::memory_order_relaxed); }

}  // namespace hostoffload

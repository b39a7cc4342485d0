// Run-time resolution of the CUDA runtime; see cuda_loader.h.
#include "cuda_loader.h"

#include "fork_safety.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

namespace hostoffload {

namespace {

using cudaError_t = int;
using HostRegisterFn = cudaError_t (*)(void*, std::size_t, unsigned);
using HostUnregisterFn = cudaError_t (*)(void*);
using GetErrorStringFn = const char* (*)(cudaError_t);
using GetLastErrorFn = cudaError_t (*)();

struct Runtime {
    HostRegisterFn host_register = nullptr;
    HostUnregisterFn host_unregister = nullptr;
    GetErrorStringFn error_string = nullptr;
    GetLastErrorFn last_error = nullptr;
    bool ok = false;
    std::string where;  // library path, or the reason it failed
};

// Sonames tried in order: newest first, so a process with several runtimes prefers the one torch is most
// likely to use; the unversioned name last (it only exists with a toolkit installed).
constexpr const char* kSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};

int find_loaded_cudart(struct dl_phdr_info* info, std::size_t, void* data) {
    if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, "libcudart.so") != nullptr) {
        *static_cast<std::string*>(data) = info->dlpi_name;
        return 1;
    }
    return 0;
}

void* open_runtime(std::string& where) {
    // 1. A runtime already in the process under a known soname (torch loads its own at import).
    for (const char* name : kSonames) {
        if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL)) {
            where = name;
            return h;
        }
    }
    // 2. Any loaded object whose path names libcudart (renamed or bundled copies).
    std::string path;
    dl_iterate_phdr(find_loaded_cudart, &path);
    if (!path.empty()) {
        if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL)) {
            where = path;
            return h;
        }
    }
    // 3. Load one ourselves.
    std::string errors;
    for (const char* name : kSonames) {
        if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
            where = name;
            return h;
        }
        const char* err = dlerror();
        errors += std::string(errors.empty() ? "" : "; ") + (err != nullptr ? err : name);
    }
    where = "no CUDA runtime could be loaded (" + errors + ")";
    return nullptr;
}

template <class Fn>
bool resolve(void* handle, const char* symbol, Fn& out, std::string& where) {
    dlerror();
    void* sym = dlsym(handle, symbol);
    if (sym == nullptr) {
        const char* err = dlerror();
        where += std::string(": missing ") + symbol + (err != nullptr ? std::string(" (") + err + ")" : "");
        return false;
    }
    out = reinterpret_cast<Fn>(sym);
    return true;
}

const Runtime& runtime() {
    static Runtime* rt = nullptr;  // immortal: used from deleters that may run at shutdown
    static std::once_flag once;
    std::call_once(once, [] {
        auto* r = new Runtime();
        void* h = open_runtime(r->where);
        if (h != nullptr) {
            r->ok = resolve(h, "cudaHostRegister", r->host_register, r->where) &&
                    resolve(h, "cudaHostUnregister", r->host_unregister, r->where) &&
                    resolve(h, "cudaGetErrorString", r->error_string, r->where) &&
                    resolve(h, "cudaGetLastError", r->last_error, r->where);
        }
        rt = r;
    });
    return *rt;
}

std::string error_text(const Runtime& r, cudaError_t code) {
    const char* s = r.error_string(code);
    r.last_error();  // clear the sticky slot
    return "CUDA error " + std::to_string(code) + ": " + (s != nullptr ? s : "unknown");
}

// ---- the pointer query (is_pinned misses) -------------------------------------------------------------------------
// Resolved separately from the registration entry points, and only from a runtime (and driver) that something else
// already loaded: asking must never be the reason CUDA gets loaded or initialised in a process.

using GetDeviceFn = cudaError_t (*)(int*);
using PointerGetAttributesFn = cudaError_t (*)(void*, const void*);
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CuDeviceGetFn = CUresult (*)(CUdevice*, int);
using CuPrimaryCtxGetStateFn = CUresult (*)(CUdevice, unsigned*, int*);
using CuPointerGetAttributesFn = CUresult (*)(unsigned, int*, void**, CUdeviceptr);

constexpr cudaError_t kCudaSuccess = 0;
constexpr cudaError_t kCudaErrorInvalidValue = 1;
constexpr int kCudaMemoryTypeHost = 1;
// Driver API values (cuda.h; fixed by the driver ABI).
constexpr CUresult kCuSuccess = 0;
constexpr int kCuPointerAttributeMemoryType = 2;
constexpr int kCuPointerAttributeIsManaged = 8;
constexpr unsigned kCuMemoryTypeHost = 1;

// cudaPointerAttributes of CUDA 11 and later starts with `enum cudaMemoryType type; int device;` followed by two
// pointers. The buffer is larger than that so a runtime with a longer struct cannot write past it.
struct alignas(16) PointerAttributes {
    int type;
    int device;
    unsigned char rest[120];
};

struct PointerApi {
    GetDeviceFn get_device = nullptr;
    PointerGetAttributesFn attributes = nullptr;
    GetLastErrorFn last_error = nullptr;
    CuDeviceGetFn device_get = nullptr;
    CuPrimaryCtxGetStateFn primary_ctx_state = nullptr;
    // Optional: the driver's several-attribute query. Where it resolves, a miss is one driver lookup that needs
    // no current context and creates none, so neither the runtime's context bookkeeping nor our per-call device
    // probe is paid; where it does not, the runtime answers as before.
    CuPointerGetAttributesFn pointer_attributes = nullptr;
    // fork_generation() when resolved. A forked child inherits this object but not a usable CUDA: the driver and
    // runtime belong to the parent, so the child never asks them (torch decides there, by its own rules).
    std::uint64_t generation = 0;
    bool ok = false;
};

void* loaded_library(const char* const* names, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
        if (void* h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL)) return h;
    }
    return nullptr;
}

// The runtime torch loaded (never one we load); nullptr while there is none. The dlopen(RTLD_NOLOAD) handles
// keep the libraries referenced, which is what the registration path does too (they are never closed).
// Lock-free once resolved. Resolution takes a mutex with try_lock only: a caller that finds it busy (or a forked
// child whose parent was resolving at the fork) gets nullptr, i.e. "ask torch", and never blocks.
std::atomic<const PointerApi*> g_pointer_api{nullptr};
std::atomic<bool> g_pointer_api_missing{false};  // resolved once and a symbol was missing: never again
std::mutex g_pointer_api_mutex;

const PointerApi* pointer_api() {
    if (const PointerApi* a = g_pointer_api.load(std::memory_order_acquire)) return a;
    if (g_pointer_api_missing.load(std::memory_order_acquire)) return nullptr;
    std::unique_lock<std::mutex> lock(g_pointer_api_mutex, std::try_to_lock);
    if (!lock.owns_lock()) return nullptr;
    if (const PointerApi* a = g_pointer_api.load(std::memory_order_acquire)) return a;
    void* rt = loaded_library(kSonames, sizeof kSonames / sizeof kSonames[0]);
    if (rt == nullptr) {
        std::string path;
        dl_iterate_phdr(find_loaded_cudart, &path);
        if (!path.empty()) rt = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    }
    constexpr const char* kDriver[] = {"libcuda.so.1", "libcuda.so"};
    void* drv = loaded_library(kDriver, 2);
    if (rt == nullptr || drv == nullptr) return nullptr;  // not loaded yet: ask again next time
    auto* a = new PointerApi();  // immortal: readers may hold it at any time
    std::string where;
    a->ok = resolve(rt, "cudaGetDevice", a->get_device, where) &&
            resolve(rt, "cudaPointerGetAttributes", a->attributes, where) &&
            resolve(rt, "cudaGetLastError", a->last_error, where) &&
            resolve(drv, "cuDeviceGet", a->device_get, where) &&
            resolve(drv, "cuDevicePrimaryCtxGetState", a->primary_ctx_state, where);
    a->generation = fork_generation();
    if (a->ok) {
        std::string optional;  // a driver without it is still usable through the runtime query
        if (!resolve(drv, "cuPointerGetAttributes", a->pointer_attributes, optional)) a->pointer_attributes = nullptr;
    }
    if (!a->ok) {
        delete a;
        g_pointer_api_missing.store(true, std::memory_order_release);
        return nullptr;
    }
    g_pointer_api.store(a, std::memory_order_release);
    return a;
}

// Devices 0..63 whose primary context this thread has seen active, in the current fork generation.
struct ContextProbe {
    std::uint64_t generation = ~std::uint64_t{0};
    std::uint64_t active = 0;
};
thread_local ContextProbe t_probe;

bool current_device_has_context(const PointerApi& api) {
    int ordinal = -1;
    if (api.get_device(&ordinal) != kCudaSuccess) {
        api.last_error();
        return false;
    }
    if (ordinal < 0 || ordinal >= 64) return false;
    const std::uint64_t generation = fork_generation();
    if (t_probe.generation != generation) t_probe = ContextProbe{generation, 0};
    const std::uint64_t bit = std::uint64_t{1} << ordinal;
    if ((t_probe.active & bit) != 0) return true;
    CUdevice dev = 0;
    unsigned flags = 0;
    int active = 0;
    if (api.device_get(&dev, ordinal) != 0 || api.primary_ctx_state(dev, &flags, &active) != 0 || active == 0) {
        return false;
    }
    t_probe.active |= bit;  // a primary context stays active until cudaDeviceReset, which torch never calls
    return true;
}

}  // namespace

int CudaHostApi::host_pointer_pinned(const void* ptr) {
    const PointerApi* api = pointer_api();
    if (api == nullptr || api->generation != fork_generation()) return -1;
    if (api->pointer_attributes != nullptr) {
        // Why the driver's several-attribute query and not the others (benchmarks/probe_pointer_query.cpp, H200,
        // issue 19): for a pageable pointer, the common case, the single-attribute cuPointerGetAttribute answers
        // "invalid value" through a slow error path (500 ns, against 119 ns for the runtime's
        // cudaPointerGetAttributes), while this query answers pageable memory with default values and success.
        // It knows every allocation, mapping and registration of every context (unified addressing), needs no
        // current context and never creates one. HOST is page-locked host memory (cudaHostAlloc or
        // cudaHostRegister), which the runtime reports as cudaMemoryTypeHost, unless it is managed memory (the
        // runtime's cudaMemoryTypeManaged; the driver reports it as device memory anyway). Both attributes are
        // asked at once: asking for the memory type alone showed no consistent gain on a pageable pointer (probe
        // runs O-Q, docs/benchmarks.md: differences in both directions, smaller than the noise between rows), and
        // a HOST answer would then pay a second call. Any other result (a driver not initialised yet, one shutting
        // down) falls through to the runtime query, which torch asks. The driver API has no sticky error slot.
        unsigned type = 0;
        int managed = 0;
        int which[2] = {kCuPointerAttributeMemoryType, kCuPointerAttributeIsManaged};
        void* values[2] = {&type, &managed};
        const auto address = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
        if (api->pointer_attributes(2, which, values, address) == kCuSuccess) {
            return (type == kCuMemoryTypeHost && managed == 0) ? 1 : 0;
        }
    }
    if (!current_device_has_context(*api)) return -1;
    PointerAttributes attr{};
    const cudaError_t err = api->attributes(&attr, ptr);
    if (err == kCudaErrorInvalidValue) {  // a pointer CUDA does not know (older runtimes): not pinned
        api->last_error();
        return 0;
    }
    if (err != kCudaSuccess) {
        api->last_error();
        return -1;
    }
    return attr.type == kCudaMemoryTypeHost ? 1 : 0;
}

bool CudaHostApi::available() { return runtime().ok; }

std::string CudaHostApi::describe() { return runtime().where; }

std::string CudaHostApi::host_register(void* ptr, std::size_t nbytes, unsigned flags) {
    const Runtime& r = runtime();
    if (!r.ok) return r.where;
    const cudaError_t code = r.host_register(ptr, nbytes, flags);
    return code == 0 ? std::string() : "cudaHostRegister failed: " + error_text(r, code);
}

std::string CudaHostApi::host_unregister(void* ptr) {
    const Runtime& r = runtime();
    if (!r.ok) return r.where;
    const cudaError_t code = r.host_unregister(ptr);
    return code == 0 ? std::string() : "cudaHostUnregister failed: " + error_text(r, code);
}

}  // namespace hostoffload

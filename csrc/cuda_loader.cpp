// Run-time resolution of the CUDA runtime; see cuda_loader.h.
#include "cuda_loader.h"

#include <dlfcn.h>
#include <link.h>

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

}  // namespace

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

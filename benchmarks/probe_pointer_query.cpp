// What one "is this host pointer pinned?" question costs CUDA, per way of asking, and what each way answers.
//
// Why this exists (issue 19): optimized.is_pinned answers a registry miss by asking CUDA, as torch's own
// Tensor.is_pinned does (cudaPointerGetAttributes). That call was the whole gap between a miss and a hit. This
// probe times the candidate questions in a tight loop, without Python, on every kind of memory the answer must
// get right (pageable, cudaHostAlloc, cudaHostRegister, device, managed), from the main thread and from a
// thread that never used the runtime (no current context), so the cheaper question is chosen on figures and its
// answers can be compared with the runtime's.
//
// Build and run on a CUDA machine (benchmarks/run_gpu.sh, part "probe-pointer-query"):
//   nvcc -O2 -std=c++17 -o /tmp/probe_pointer_query benchmarks/probe_pointer_query.cpp -lcuda && /tmp/probe_pointer_query
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

void check_rt(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(err));
        std::exit(1);
    }
}

// Median over 7 rounds of the mean ns per call of `calls` calls.
double ns_per_call(const std::function<void()>& fn, int calls = 200000) {
    std::vector<double> rounds;
    for (int r = 0; r < 7; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) fn();
        const auto t1 = std::chrono::steady_clock::now();
        rounds.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / calls);
    }
    std::sort(rounds.begin(), rounds.end());
    return rounds[rounds.size() / 2];
}

struct Memory {
    const char* name;
    void* ptr;
};

// The runtime's answer, as torch's isPinnedPtr reads it.
std::string runtime_answer(void* p) {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, p);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return std::string("error ") + std::to_string(err);
    }
    return attr.type == cudaMemoryTypeHost ? "pinned" : "type " + std::to_string(attr.type);
}

// The driver's several-attribute answer, as CudaHostApi::host_pointer_pinned reads it: both attributes at once.
std::string driver_attributes_answer(void* p) {
    unsigned type = 0;
    int managed = 0;
    CUpointer_attribute which[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED};
    void* values[2] = {&type, &managed};
    const CUresult res =
        cuPointerGetAttributes(2, which, values, static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
    if (res != CUDA_SUCCESS) return "error " + std::to_string(res);
    if (type == CU_MEMORYTYPE_HOST && managed == 0) return "pinned";
    return "type " + std::to_string(type) + (managed ? " (managed)" : "");
}

// The alternative measured in runs O and P: the memory type alone, and whether the memory is managed only when the
// type is HOST (1 pinned, 0 not, -1 no answer), so that a pageable pointer is asked about one attribute.
int type_first_pinned(void* p) {
    const auto address = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
    unsigned type = 0;
    CUpointer_attribute which_type = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    void* type_value = &type;
    if (cuPointerGetAttributes(1, &which_type, &type_value, address) != CUDA_SUCCESS) return -1;
    if (type != CU_MEMORYTYPE_HOST) return 0;
    int managed = 0;
    CUpointer_attribute which_managed = CU_POINTER_ATTRIBUTE_IS_MANAGED;
    void* managed_value = &managed;
    if (cuPointerGetAttributes(1, &which_managed, &managed_value, address) != CUDA_SUCCESS) return -1;
    return managed == 0 ? 1 : 0;
}

std::string type_first_answer(void* p) {
    const int pinned = type_first_pinned(p);
    return pinned == 1 ? "pinned" : pinned == 0 ? "not pinned" : "error";
}

// The driver's single-attribute answer (first tried, issue 19: slow on pageable memory).
std::string driver_answer(void* p) {
    unsigned type = 0;
    const auto address = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
    const CUresult res = cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address);
    if (res == CUDA_ERROR_INVALID_VALUE) return "unknown (pageable)";
    if (res != CUDA_SUCCESS) return "error " + std::to_string(res);
    int managed = 0;
    const CUresult m = cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, address);
    if (m != CUDA_SUCCESS) return "type " + std::to_string(type) + ", is_managed error " + std::to_string(m);
    if (type == CU_MEMORYTYPE_HOST && managed == 0) return "pinned";
    return "type " + std::to_string(type) + (managed ? " (managed)" : "");
}

}  // namespace

int main() {
    check_rt(cudaSetDevice(0), "cudaSetDevice");
    check_rt(cudaFree(nullptr), "cudaFree(0)");  // the primary context, as in any training process
    const std::size_t n = 1 << 20;
    void* pageable = std::malloc(n);
    std::memset(pageable, 1, n);
    void* registered = std::malloc(n);
    std::memset(registered, 1, n);
    check_rt(cudaHostRegister(registered, n, cudaHostRegisterDefault), "cudaHostRegister");
    void* host_alloc = nullptr;
    check_rt(cudaHostAlloc(&host_alloc, n, cudaHostAllocDefault), "cudaHostAlloc");
    void* device = nullptr;
    check_rt(cudaMalloc(&device, n), "cudaMalloc");
    void* managed = nullptr;
    check_rt(cudaMallocManaged(&managed, n), "cudaMallocManaged");
    const std::vector<Memory> kinds = {{"pageable", pageable},
                                       {"pageable+4096", static_cast<char*>(pageable) + 4096},
                                       {"cudaHostAlloc", host_alloc},
                                       {"cudaHostAlloc+4096", static_cast<char*>(host_alloc) + 4096},
                                       {"cudaHostRegister", registered},
                                       {"cudaMalloc", device},
                                       {"cudaMallocManaged", managed}};

    std::printf("answers (main thread | fresh thread that never used the runtime):\n");
    for (const Memory& m : kinds) {
        std::string fresh_driver;
        std::string fresh_attributes;
        std::thread([&] {
            fresh_driver = driver_answer(m.ptr);
            fresh_attributes = driver_attributes_answer(m.ptr);
        }).join();
        std::printf("  %-20s runtime: %-10s driver: %-20s driver, fresh thread: %-20s | ours: %-12s fresh thread: "
                    "%-12s | type first: %s\n",
                    m.name, runtime_answer(m.ptr).c_str(), driver_answer(m.ptr).c_str(), fresh_driver.c_str(),
                    driver_attributes_answer(m.ptr).c_str(), fresh_attributes.c_str(),
                    type_first_answer(m.ptr).c_str());
    }

    std::printf("ns per call (median of 7 rounds of 200000 calls), pageable | cudaHostAlloc pointer:\n");
    volatile int sink = 0;
    auto row = [&](const char* what, const std::function<void(void*)>& fn) {
        const double a = ns_per_call([&] { fn(pageable); });
        const double b = ns_per_call([&] { fn(host_alloc); });
        std::printf("  %-52s %8.1f | %8.1f\n", what, a, b);
    };
    row("cudaPointerGetAttributes (torch's question)", [&](void* p) {
        cudaPointerAttributes attr{};
        if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) cudaGetLastError();
        sink = sink + attr.type;
    });
    row("cuPointerGetAttribute(MEMORY_TYPE)", [&](void* p) {
        unsigned type = 0;
        cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                              static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
        sink = sink + static_cast<int>(type);
    });
    row("cuPointerGetAttribute(MEMORY_TYPE) + (IS_MANAGED if HOST)", [&](void* p) { sink = sink + driver_answer(p).size(); });
    row("ours: cuPointerGetAttributes(MEMORY_TYPE, IS_MANAGED), raw", [&](void* p) {
        unsigned type = 0;
        int managed = 0;
        CUpointer_attribute which[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED};
        void* values[2] = {&type, &managed};
        cuPointerGetAttributes(2, which, values, static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
        sink = sink + static_cast<int>(type) + managed;
    });
    row("cuPointerGetAttributes(MEMORY_TYPE) [+ (IS_MANAGED) if HOST]", [&](void* p) {
        sink = sink + type_first_pinned(p);
    });
    row("cuPointerGetAttributes(MEMORY_TYPE), raw", [&](void* p) {
        unsigned type = 0;
        CUpointer_attribute which = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
        void* value = &type;
        cuPointerGetAttributes(1, &which, &value, static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
        sink = sink + static_cast<int>(type);
    });
    row("cuMemHostGetFlags", [&](void* p) {
        unsigned flags = 0;
        sink = sink + static_cast<int>(cuMemHostGetFlags(&flags, p));
    });
    row("cudaGetDevice (the context probe's per-call part)", [&](void*) {
        int d = 0;
        cudaGetDevice(&d);
        sink = sink + d;
    });
    row("getenv(\"HOSTOFFLOAD_ACCELERATOR\")", [&](void*) { sink = sink + (std::getenv("HOSTOFFLOAD_ACCELERATOR") != nullptr); });
    std::printf("environment variables: %d\n", [] {
        extern char** environ;
        int c = 0;
        for (char** e = environ; *e != nullptr; ++e) ++c;
        return c;
    }());

    check_rt(cudaFree(managed), "cudaFree(managed)");
    check_rt(cudaFree(device), "cudaFree(device)");
    check_rt(cudaFreeHost(host_alloc), "cudaFreeHost");
    check_rt(cudaHostUnregister(registered), "cudaHostUnregister");
    std::free(registered);
    std::free(pageable);
    return sink == 42 ? 2 : 0;
}

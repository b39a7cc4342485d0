// The CUDA runtime entry points hostoffload needs, resolved with dlopen at run time.
//
// Why run time: the extension must import and work on machines without CUDA (CI, CPU-only torch), and it
// must use the SAME CUDA runtime instance torch uses, so that torch.Tensor.is_pinned() sees our
// registrations. So nothing is linked: on first use we look for a libcudart that is already loaded into the
// process (torch's), and only if there is none we dlopen one by soname. The handle is never closed.
#pragma once

#include <cstddef>
#include <string>

namespace hostoffload {

struct CudaHostApi {
    // cudaHostRegister flags (values fixed by the CUDA runtime ABI).
    static constexpr unsigned kRegisterPortable = 0x01;
    static constexpr unsigned kRegisterMapped = 0x02;

    // True once the runtime was found and every entry point resolved. Thread-safe, loads at most once.
    static bool available();
    // Why it is not available (empty when it is), or where it was loaded from (when it is).
    static std::string describe();

    // Returns an empty string on success, otherwise the runtime's error text (the sticky last-error slot is
    // cleared again so the failure does not surface later inside an unrelated torch call).
    static std::string host_register(void* ptr, std::size_t nbytes, unsigned flags);
    // Same convention. Safe to call during process shutdown: a runtime that is already unloading answers
    // with an error code, which the caller may ignore.
    static std::string host_unregister(void* ptr);

    // What torch's Tensor.is_pinned() answers for a host pointer, without Python: 1 if CUDA reports page-locked
    // host memory (cudaPointerGetAttributes type cudaMemoryTypeHost; asked of the driver first, where one
    // cuPointerGetAttributes lookup answers without any context bookkeeping), 0 if it reports anything else
    // (including "unknown pointer"), -1 if it cannot be asked here without side effects, and the caller must
    // ask torch: no runtime is loaded in the process yet (this never loads one), this is a forked child of the
    // process that found it (CUDA is the parent's), an entry point is missing, the calling thread's current
    // device has no active primary context (asking would create one, which torch avoids too), or any call failed
    // (the sticky error slot is cleared). Thread-safe; a positive context probe is cached per thread and per
    // fork generation; with the driver query (the common case) it is not needed.
    static int host_pointer_pinned(const void* ptr);
};

}  // namespace hostoffload

// Binding of the CPU Adam kernels (cpu_adam.h) into optimized._native as the submodule `cpu_adam`. It takes raw
// addresses from the Python wrapper (optimized/cpu_adam.py validates the tensors), so the extension links neither
// torch nor CUDA, and it releases the GIL while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "cpu_adam.h"
#include "worker_pool.h"

namespace py = pybind11;
namespace ca = hostoffload::cpu_adam;

namespace {
// Runs fn with the GIL released. Deliberately not pybind11's RAII gil_scoped_release: when the interpreter shuts
// down while a daemon thread is in the kernel, CPython ends that thread inside PyEval_RestoreThread with
// pthread_exit, whose forced unwind aborts the process ("terminate called without an active exception") if it
// has to leave a destructor (destructors are noexcept). Restoring in ordinary code lets the unwind pass through
// (pybind11's dispatcher rethrows it), so the process exits normally.
template <typename Fn>
void without_gil(const Fn& fn) {
    PyThreadState* state = PyEval_SaveThread();
    try {
        fn();
    } catch (...) {
        PyEval_RestoreThread(state);
        throw;
    }
    PyEval_RestoreThread(state);
}
}  // namespace

void hostoffload::bind_cpu_adam(py::module_& m) {
    m.def("available_isas", &ca::available_isas, "ISA variants this CPU can run, slowest first.");
    m.def("best_isa", &ca::best_isa, "The fastest ISA variant this CPU can run.");
    m.def(
        "adam_step",
        [](std::uintptr_t param, std::uintptr_t grad, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
           std::uintptr_t bf16_out, std::size_t n, double beta1, double one_minus_beta1, double beta2,
           double one_minus_beta2, double inv_bias_correction2, double eps, double step_size, double decay,
           double grad_scale, bool decoupled, bool has_weight_decay, bool has_grad_scale, const std::string& isa,
           int threads, const std::string& state_precision, std::uintptr_t backup_param,
           std::uintptr_t backup_exp_avg, std::uintptr_t backup_exp_avg_sq, const std::string& grad_precision) {
            // Casting each fp64 hyper-parameter to fp32 rounds it to nearest once, as torch does when a Python
            // float meets an fp32 tensor.
            const ca::AdamScalars s{static_cast<float>(beta1),      static_cast<float>(one_minus_beta1),
                                    static_cast<float>(beta2),      static_cast<float>(one_minus_beta2),
                                    static_cast<float>(inv_bias_correction2), static_cast<float>(eps),
                                    static_cast<float>(step_size),  static_cast<float>(decay),
                                    static_cast<float>(grad_scale), decoupled,
                                    has_weight_decay,               has_grad_scale};
            const ca::AdamArrays a{reinterpret_cast<float*>(param),         reinterpret_cast<const void*>(grad),
                                   reinterpret_cast<void*>(exp_avg),          reinterpret_cast<void*>(exp_avg_sq),
                                   reinterpret_cast<std::uint16_t*>(bf16_out), n,
                                   ca::parse_state_precision(state_precision),
                                   reinterpret_cast<float*>(backup_param), reinterpret_cast<void*>(backup_exp_avg),
                                   reinterpret_cast<void*>(backup_exp_avg_sq),
                                   ca::parse_state_precision(grad_precision)};
            const ca::Isa which = ca::parse_isa(isa);
            without_gil([&] { ca::adam_step(a, s, which, threads); });
        },
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("bf16_out"),
        py::arg("n"), py::arg("beta1"), py::arg("one_minus_beta1"), py::arg("beta2"), py::arg("one_minus_beta2"),
        py::arg("inv_bias_correction2"), py::arg("eps"), py::arg("step_size"), py::arg("decay"),
        py::arg("grad_scale"), py::arg("decoupled"), py::arg("has_weight_decay"), py::arg("has_grad_scale"),
        py::arg("isa"), py::arg("threads"), py::arg("state_precision") = "fp32", py::arg("backup_param") = 0,
        py::arg("backup_exp_avg") = 0, py::arg("backup_exp_avg_sq") = 0, py::arg("grad_precision") = "fp32");
    m.def(
        "cast_to_bf16",
        [](std::uintptr_t src, std::uintptr_t dst, std::size_t n, const std::string& isa, int threads) {
            const ca::Isa which = ca::parse_isa(isa);
            without_gil([&] {
                ca::cast_to_bf16(reinterpret_cast<const float*>(src), reinterpret_cast<std::uint16_t*>(dst), n,
                                 which, threads);
            });
        },
        py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("isa"), py::arg("threads"));
    m.def("pool_workers", &hostoffload::worker_pool::started_workers,
          "Worker threads this process's pool has started (callers excluded); 0 before the first parallel call.");
}

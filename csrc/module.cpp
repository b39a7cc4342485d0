// Python binding of hostoffload's native layer (optimized._native).
//
// This file only binds: every concept lives in its own translation unit and is added to
// HOSTOFFLOAD_SOURCES in CMakeLists.txt. The module never links against CUDA or torch, so it
// imports on any machine; device entry points are resolved at run time.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
    m.doc() = "hostoffload native layer: pinned host memory and the process-wide pinned-range registry";
    m.attr("ABI_VERSION") = 1;
}

// The binding units of the one extension module optimized._native (module.cpp defines the module and calls
// these). Kernels and data structures never include Python; only the bind_*.cpp files and module.cpp do.
#pragma once

#include <pybind11/pybind11.h>

namespace hostoffload {

// optimized._native.cpu_adam: the CPU Adam/AdamW kernels (optimized/cpu_adam.py is the public wrapper).
void bind_cpu_adam(pybind11::module_& m);

}  // namespace hostoffload

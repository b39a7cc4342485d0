// optimized._native_testing: native self-tests, built only for test runs (CMake option HOSTOFFLOAD_TEST_EXTENSIONS,
// which tox's package build turns on; a plain `pip install .` leaves it out). Never part of the production
// extension optimized._native.
//
// stress_registry: native threads reading and writing a private RangeRegistry at once, without the GIL (see
// registry_stress.h). It compiles its own copy of range_registry.cpp: the registries it stresses are private, so
// sharing the production module's process-wide instance is not needed.
#include <pybind11/pybind11.h>

#include "registry_stress.h"

namespace py = pybind11;

PYBIND11_MODULE(_native_testing, m) {
    m.doc() = "hostoffload native self-tests (test builds only)";
    m.def(
        "stress_registry",
        [](int readers, int writers, int ops_per_writer) {
            if (readers < 1 || writers < 1 || ops_per_writer < 1) {
                throw py::value_error("stress_registry needs readers, writers and ops_per_writer >= 1");
            }
            hostoffload::StressResult r;
            {
                py::gil_scoped_release unlocked;
                r = hostoffload::stress_registry(readers, writers, ops_per_writer);
            }
            py::dict d;
            d["reads"] = r.reads;
            d["writes"] = r.writes;
            d["violations"] = r.violations;
            d["first_violation"] = r.first_violation;
            d["final_ranges"] = r.final_ranges;
            d["retired_pending"] = r.retired_pending;
            return d;
        },
        py::arg("readers"), py::arg("writers"), py::arg("ops_per_writer"),
        "Native threads reading and writing a private registry at once, without the GIL (see registry_stress.h).");
}

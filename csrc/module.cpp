// Python binding of hostoffload's native layer (optimized._native).
//
// This file only binds: every concept lives in its own translation unit (range_registry, host_allocator,
// dlpack_export, cuda_loader, slab_arena). The module never links against CUDA or torch, so it imports on any
// machine; device entry points are resolved at run time.
//
// Errors are raised as the shared classes of reference.contract.errors (looked up once, at import), so callers catch
// the same types whichever implementation is underneath.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_loader.h"
#include "dlpack_export.h"
#include "fork_safety.h"
#include "host_allocator.h"
#include "range_registry.h"
#include "slab_arena.h"

namespace py = pybind11;
using namespace hostoffload;

namespace {

// Borrowed forever: exception classes and PinnedRange must outlive every call, including calls made while the
// interpreter tears modules down, so they are never released.
PyObject* g_configuration_error = nullptr;
PyObject* g_lock_error = nullptr;
PyObject* g_pinned_range = nullptr;

PyObject* pinned_range_type() {
    if (g_pinned_range == nullptr) {
        py::object cls = py::module_::import("reference.contract.pinning_rules").attr("PinnedRange");  // NOLINT
        g_pinned_range = cls.release().ptr();
    }
    return g_pinned_range;
}

[[noreturn]] void raise_configuration_error(const std::string& msg) {
    PyErr_SetString(g_configuration_error, msg.c_str());
    throw py::error_already_set();
}

// Converts a Python int to uint64 without raising: false for non-ints, negatives and values >= 2**64.
bool to_u64(PyObject* o, std::uint64_t& out) {
    if (!PyLong_Check(o)) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        if (v < 0) return false;
        out = static_cast<std::uint64_t>(v);
        return true;
    }
    if (overflow < 0) return false;
    const unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    out = u;
    return true;
}

// The ranges arguments' rule and its messages live once, in the contract (reference.contract.pinning_rules:
// check_range_int, check_range_end). The binding accepts valid values without calling Python and asks the contract
// to raise for anything else, with the registry's 64-bit limit. Borrowed forever, like the error classes.
PyObject* g_check_range_int = nullptr;
PyObject* g_check_range_end = nullptr;
PyObject* g_address_limit = nullptr;  // 2**64

[[noreturn]] void raise_from_contract(PyObject* check, PyObject* args) {
    PyObject* r = PyObject_CallObject(check, args);
    Py_XDECREF(args);
    if (r == nullptr) throw py::error_already_set();
    Py_DECREF(r);
    // The contract accepted what the native registry cannot store: a bug in one of the two, never a user error.
    throw std::logic_error("reference.contract.pinning_rules accepted a value the native registry refused");
}

std::uint64_t checked_int(const char* name, py::handle value, std::uint64_t minimum) {
    std::uint64_t out = 0;
    if (!PyBool_Check(value.ptr()) && to_u64(value.ptr(), out) && out >= minimum) return out;
    raise_from_contract(g_check_range_int, Py_BuildValue("(sOKO)", name, value.ptr(),
                                                         static_cast<unsigned long long>(minimum), g_address_limit));
}

void check_range_end(std::uint64_t start, std::uint64_t nbytes) {
    // start + nbytes <= 2**64 (the contract's limit, a range may end exactly there) without overflowing; nbytes >= 1
    // was checked before, and the registry stores the range's last byte, start + nbytes - 1.
    if (nbytes - 1 <= std::numeric_limits<std::uint64_t>::max() - start) return;
    raise_from_contract(g_check_range_end, Py_BuildValue("(KKO)", static_cast<unsigned long long>(start),
                                                         static_cast<unsigned long long>(nbytes), g_address_limit));
}

py::object make_range(const RangeEntry& e) {
    PyObject* r = PyObject_CallFunction(pinned_range_type(), "KKK", static_cast<unsigned long long>(e.start),
                                        static_cast<unsigned long long>(e.last - e.start + 1),
                                        static_cast<unsigned long long>(e.owner));
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
}

void registry_add(RangeRegistry& reg, py::handle start, py::handle nbytes, py::handle owner) {
    const std::uint64_t s = checked_int("start", start, 1);
    const std::uint64_t n = checked_int("nbytes", nbytes, 1);
    const std::uint64_t o = checked_int("owner", owner, 0);
    check_range_end(s, n);
    reg.add(s, n, o);
}

bool registry_contains(const RangeRegistry& reg, PyObject* ptr, PyObject* nbytes) {
    // Reference rule for bad extents: ptr <= 0 or nbytes < 0 is never pinned; neither is anything past 2**64.
    std::uint64_t p = 0;
    std::uint64_t n = 0;
    if (!PyLong_Check(ptr) || !PyLong_Check(nbytes)) {
        throw py::type_error("ptr and nbytes must be ints");
    }
    if (!to_u64(ptr, p) || p == 0 || !to_u64(nbytes, n)) return false;
    return reg.contains(p, n);
}

// Fast path for `is_pinned`: one METH_FASTCALL call, no argument parsing layer. registry_contains(ptr, nbytes)
// on the process-wide registry.
PyObject* fast_registry_contains(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "registry_contains(ptr, nbytes) takes exactly 2 arguments");
        return nullptr;
    }
    std::uint64_t p = 0;
    std::uint64_t n = 0;
    if (!PyLong_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "ptr and nbytes must be ints");
        return nullptr;
    }
    if (!to_u64(args[0], p) || p == 0 || !to_u64(args[1], n)) Py_RETURN_FALSE;
    if (RangeRegistry::global().contains(p, n)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

// Plain tensor types (torch.Tensor, torch.nn.Parameter), torch.strided and interned attribute names for the
// is_pinned fast path. Set once from Python (this module does not import torch).
PyObject* g_tensor_type = nullptr;
PyObject* g_parameter_type = nullptr;
PyObject* g_strided = nullptr;
PyObject* g_name_is_cpu = nullptr;
PyObject* g_name_data_ptr = nullptr;
PyObject* g_name_is_contiguous = nullptr;
PyObject* g_name_nbytes = nullptr;
PyObject* g_name_layout = nullptr;

PyObject* call_method0(PyObject* self, PyObject* name) {
    PyObject* args[] = {self};
    return PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// What the fast path learnt about a tensor.
enum class Probe {
    kError,    // a Python error is set
    kGeneral,  // the general (Python) path must decide: not a plain tensor, strided view, no data pointer, ...
    kDevice,   // a plain strided tensor that is not on the CPU: never pinned (the specification's answer)
    kHit,      // a plain contiguous CPU tensor whose extent lies in one registered range
    kMiss,     // a plain contiguous CPU tensor outside every range; ptr and nbytes are set
};

Probe probe_tensor(PyObject* t, std::uint64_t& p, std::uint64_t& n) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(t));
    if (g_tensor_type == nullptr || (type != g_tensor_type && type != g_parameter_type)) return Probe::kGeneral;
    PyObject* is_cpu = PyObject_GetAttr(t, g_name_is_cpu);
    if (is_cpu == nullptr) return Probe::kError;
    const bool cpu = is_cpu == Py_True;
    Py_DECREF(is_cpu);
    if (!cpu) {
        // Device, meta and functional wrappers alike: the answer is False once the layout is dense (a sparse one
        // is refused by name on the general path). A miss on a device tensor costs two attribute reads.
        PyObject* layout = PyObject_GetAttr(t, g_name_layout);
        if (layout == nullptr) return Probe::kError;
        const bool strided = layout == g_strided;
        Py_DECREF(layout);
        return strided ? Probe::kDevice : Probe::kGeneral;
    }
    PyObject* contiguous = call_method0(t, g_name_is_contiguous);
    if (contiguous == nullptr) {
        PyErr_Clear();  // layouts without strides (sparse CSR): the general path refuses them by name
        return Probe::kGeneral;
    }
    const bool contig = contiguous == Py_True;
    Py_DECREF(contiguous);
    if (!contig) return Probe::kGeneral;
    PyObject* ptr = call_method0(t, g_name_data_ptr);
    if (ptr == nullptr) {
        PyErr_Clear();  // storage-less wrappers: let the general path decide
        return Probe::kGeneral;
    }
    const bool ptr_ok = to_u64(ptr, p);
    Py_DECREF(ptr);
    PyObject* nbytes = PyObject_GetAttr(t, g_name_nbytes);
    if (nbytes == nullptr) return Probe::kError;
    const bool n_ok = to_u64(nbytes, n);
    Py_DECREF(nbytes);
    if (!ptr_ok || !n_ok || p == 0) {
        p = 0;
        return Probe::kMiss;
    }
    return RangeRegistry::global().contains(p, n) ? Probe::kHit : Probe::kMiss;
}

// tensor_in_registry(t) -> True | False | None. True/False: t is a plain contiguous CPU tensor and its extent
// (data_ptr, nbytes) is / is not inside one range of the process-wide registry. None: t needs the general path
// (not a plain tensor, not on the CPU, not contiguous, or its data pointer is unavailable). Exists because every
// Python-level attribute access costs tens of nanoseconds and is_pinned is called on every copy decision.
PyObject* fast_tensor_in_registry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "tensor_in_registry(t) takes exactly 1 argument");
        return nullptr;
    }
    std::uint64_t p = 0;
    std::uint64_t n = 0;
    switch (probe_tensor(args[0], p, n)) {
        case Probe::kError:
            return nullptr;
        case Probe::kHit:
            Py_RETURN_TRUE;
        case Probe::kMiss:
            Py_RETURN_FALSE;
        case Probe::kGeneral:
        case Probe::kDevice:
            break;
    }
    Py_RETURN_NONE;
}

// is_pinned(t): the whole public is_pinned for the common cases in one C call, read top-down:
//   1. a plain contiguous CPU tensor in the registry: True;
//   2. a plain strided tensor not on the CPU (device, meta): False;
//   3. a plain contiguous CPU tensor outside every range (a miss, the common case of a copy decision): False
//      without torch pinning on the current accelerator; with it, the CUDA runtime's pointer attributes where the
//      stock CUDA accelerator is current (CudaHostApi::host_pointer_pinned, no Python), else torch's own
//      Tensor.is_pinned(). Which one applies is cached per value of HOSTOFFLOAD_ACCELERATOR and per fork
//      generation (set_miss_answer, from optimized.pinning); until then, or when the runtime cannot answer, the
//      Python fallback decides;
//   4. everything else: the Python fallback(t, hit) installed by optimized.pinning (hit is False for a miss,
//      None when the general path must decide).
// The cache is read and written under the GIL only.
PyObject* g_is_pinned_fallback = nullptr;
PyObject* g_name_is_pinned = nullptr;
bool g_miss_known = false;      // the fields below are valid (in the process of generation g_miss_generation)
std::uint64_t g_miss_generation = 0;  // fork_generation() when cached: a forked child asks Python again
bool g_miss_env_set = false;    // HOSTOFFLOAD_ACCELERATOR was set when the answer was cached ...
std::string g_miss_env;         // ... to this value
bool g_miss_torch_pinning = false;
bool g_miss_cuda_pointers = false;  // the CUDA runtime may be asked directly

// HOSTOFFLOAD_ACCELERATOR's value (nullptr: unset) without scanning the environment on every call. getenv
// compares the name against every variable: 85-130 ns with the 96 variables of the H200 box (issue 19's probe),
// most of a miss's budget, and training jobs under a scheduler carry more. So what the environment looked like is
// remembered, and a call scans it again only when that picture no longer holds. The picture rests on one fact of
// the C library: an entry's string is never edited in place (setenv and putenv store another string, unsetenv
// removes the pointer; CPython's os.environ goes through setenv and unsetenv), so equal pointers mean equal text.
//   - set: the array is the same and the same entry string sits at the same index. That entry is the variable
//     with the remembered value, and the library keeps names unique, so it is what getenv would find;
//   - unset: the array is the same and holds exactly the same entry pointers, in order, up to its end (a copy
//     is compared, 8 bytes per variable). A cheaper test, such as the same length and the same last entry, is
//     not enough: set the variable (appended), remove the last entry and set it again (the library may hand back
//     its very same string), remove an earlier one, and the length and last entry are as before.
// A program writing into `environ` or into a string it handed to putenv, by hand, is not seen until the array
// changes otherwise; nothing in this library or in CPython does that. Read and written under the GIL.
extern "C" char** environ;
struct AcceleratorEnv {
    char** array = nullptr;       // environ when last scanned (nullptr: never scanned, or no environment at all)
    std::size_t index = 0;        // set: the variable's slot
    const char* entry = nullptr;  // set: environ[index]
    bool present = false;
    std::vector<char*> entries;   // unset: every entry pointer, in order (the terminating nullptr excluded)
};
AcceleratorEnv g_accelerator_env;

const char* accelerator_env_value() {
    static constexpr char kName[] = "HOSTOFFLOAD_ACCELERATOR=";
    static constexpr std::size_t kNameLen = sizeof kName - 1;
    AcceleratorEnv& c = g_accelerator_env;
    char** env = environ;
    if (env != nullptr && env == c.array) {
        if (c.present) {
            if (env[c.index] == c.entry) return c.entry + kNameLen;
        } else {
            // Slots up to the remembered end are inside the array: unsetenv only moves entries down within it.
            const std::size_t n = c.entries.size();
            if (env[n] == nullptr && (n == 0 || std::memcmp(env, c.entries.data(), n * sizeof(char*)) == 0)) {
                return nullptr;
            }
        }
    }
    c.array = nullptr;
    c.present = false;
    c.entries.clear();
    if (env == nullptr) return nullptr;
    std::size_t i = 0;
    for (; env[i] != nullptr; ++i) {
        if (std::strncmp(env[i], kName, kNameLen) == 0) {
            c.array = env;
            c.index = i;
            c.entry = env[i];
            c.present = true;
            return env[i] + kNameLen;
        }
    }
    c.entries.assign(env, env + i);
    c.array = env;
    return nullptr;
}

// 1: the cached answer applies to the current environment; 0: it does not (or none is cached).
int miss_cache_applies() {
    if (!g_miss_known || g_miss_generation != fork_generation()) return 0;
    const char* env = accelerator_env_value();
    if (env == nullptr) return g_miss_env_set ? 0 : 1;
    return (g_miss_env_set && g_miss_env == env) ? 1 : 0;
}

// A miss answered without Python: nullptr with no error set means "not answered here, use the fallback".
PyObject* answer_miss(PyObject* t, std::uint64_t p, std::uint64_t n) {
    if (!miss_cache_applies()) return nullptr;
    if (!g_miss_torch_pinning || n == 0 || p == 0) Py_RETURN_FALSE;  // no bytes: never pinned (specification)
    if (g_miss_cuda_pointers) {
        const int pinned = CudaHostApi::host_pointer_pinned(reinterpret_cast<const void*>(p));
        if (pinned == 1) Py_RETURN_TRUE;
        if (pinned == 0) Py_RETURN_FALSE;
        // -1: the runtime cannot answer here without side effects; torch decides, as below.
    }
    if (g_name_is_pinned == nullptr) return nullptr;
    PyObject* r = call_method0(t, g_name_is_pinned);
    if (r == nullptr) return nullptr;
    const int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (truth < 0) return nullptr;
    if (truth) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyObject* fast_is_pinned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "is_pinned(t) takes exactly 1 argument");
        return nullptr;
    }
    std::uint64_t p = 0;
    std::uint64_t n = 0;
    PyObject* hit = Py_None;
    switch (probe_tensor(args[0], p, n)) {
        case Probe::kError:
            return nullptr;
        case Probe::kHit:
            Py_RETURN_TRUE;
        case Probe::kDevice:
            Py_RETURN_FALSE;
        case Probe::kMiss: {
            PyObject* answer = answer_miss(args[0], p, n);
            if (answer != nullptr || PyErr_Occurred()) return answer;
            hit = Py_False;
            break;
        }
        case Probe::kGeneral:
            break;
    }
    if (g_is_pinned_fallback == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "optimized._native.is_pinned used before optimized.pinning was imported");
        return nullptr;
    }
    PyObject* call_args[] = {args[0], hit};
    return PyObject_Vectorcall(g_is_pinned_fallback, call_args, 2, nullptr);
}

PyMethodDef g_fast_methods[] = {
    {"is_pinned", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_is_pinned)), METH_FASTCALL,
     "is_pinned(t) -> bool\n\nTrue iff t's whole byte extent is pinned host memory (optimized.pinning.is_pinned). "
     "Registry hits of plain contiguous CPU tensors are answered here; everything else goes to the fallback that "
     "optimized.pinning installs."},
    {"tensor_in_registry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_tensor_in_registry)),
     METH_FASTCALL,
     "tensor_in_registry(t) -> True/False for a plain contiguous CPU tensor (its extent is / is not inside one "
     "registered range), None when t needs the general is_pinned path."},
    {"registry_contains", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_registry_contains)),
     METH_FASTCALL,
     "registry_contains(ptr, nbytes) -> bool: the range rule on the process-wide registry, with no binding layer "
     "in between (the is_pinned fast path)."},
    {nullptr, nullptr, 0, nullptr},
};

HugePageMode parse_huge_pages(const std::string& mode) {
    if (mode == "auto") return HugePageMode::kAuto;
    if (mode == "thp") return HugePageMode::kTransparent;
    if (mode == "hugetlb") return HugePageMode::kHugetlb;
    if (mode == "off") return HugePageMode::kOff;
    raise_configuration_error("huge_pages=" + mode + " is not allowed; allowed values: auto, thp, hugetlb, off");
}

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

}  // namespace

// The error of an external unregister hook that failed inside unpin(), kept for the thread that called unpin
// (the hook runs in that thread) until unpin_outcome() raises it there.
thread_local PyObject* t_hook_error_type = nullptr;
thread_local PyObject* t_hook_error_value = nullptr;
thread_local PyObject* t_hook_error_tb = nullptr;

void stash_hook_error() {  // GIL held, a Python error set
    Py_XDECREF(t_hook_error_type);
    Py_XDECREF(t_hook_error_value);
    Py_XDECREF(t_hook_error_tb);
    PyErr_Fetch(&t_hook_error_type, &t_hook_error_value, &t_hook_error_tb);
}

// 1: unpinned now, 0: was not pinned; a failed hook raises its own exception in the caller (GIL held).
int unpin_outcome(Allocation::UnpinResult r) {
    if (r == Allocation::UnpinResult::kUnpinned) return 1;
    if (r == Allocation::UnpinResult::kNotPinned) return 0;
    if (t_hook_error_type == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "the accelerator's unregister hook failed; the buffer is still pinned");
    } else {
        PyErr_Restore(t_hook_error_type, t_hook_error_value, t_hook_error_tb);
        t_hook_error_type = t_hook_error_value = t_hook_error_tb = nullptr;
    }
    throw py::error_already_set();
}

PYBIND11_MODULE(_native, m) {
    m.doc() = "hostoffload native layer: pinned host memory and the process-wide pinned-range registry";
    m.attr("ABI_VERSION") = 2;
    if (const int err = install_fork_handlers(); err != 0) {
        throw std::runtime_error("pthread_atfork failed (error " + std::to_string(err) +
                                 "): the native layer cannot be made fork-safe");
    }

    py::module_ errors = py::module_::import("reference.contract.errors");
    g_configuration_error = py::object(errors.attr("ConfigurationError")).release().ptr();
    g_lock_error = py::object(errors.attr("PinnedMemoryLockError")).release().ptr();
    py::module_ rules = py::module_::import("reference.contract.pinning_rules");
    g_check_range_int = py::object(rules.attr("check_range_int")).release().ptr();
    g_check_range_end = py::object(rules.attr("check_range_end")).release().ptr();
    g_address_limit = (py::int_(std::numeric_limits<std::uint64_t>::max()) + py::int_(1)).release().ptr();

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const LockError& e) {
            const std::string msg = std::string(e.what()) +
                                    ". The locked-memory limit is too small: raise it with `ulimit -l unlimited` (or "
                                    "the memlock entry in /etc/security/limits.conf, or the container's --ulimit "
                                    "memlock), or pin less memory.";
            PyErr_SetString(g_lock_error, msg.c_str());
        } catch (const HostAllocError& e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
        } catch (const RangeOverlapError& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        } catch (const std::invalid_argument& e) {
            PyErr_SetString(g_configuration_error, e.what());
        }
    });

    // ---- range registry -------------------------------------------------------------------------------------
    py::class_<RangeRegistry>(m, "RangeRegistry", R"doc(
A set of non-overlapping byte ranges with whole-extent containment queries (the rule of reference.ranges).

Lookups never take a lock (copy-on-write snapshots with epoch-based reclamation); add/remove serialise on a
writer mutex. Same methods, arguments, results and errors as reference.ranges.RangeRegistry.)doc")
        .def(py::init<>())
        .def(
            "add", [](RangeRegistry& r, py::handle start, py::handle nbytes, py::handle owner) { registry_add(r, start, nbytes, owner); },
            py::arg("start"), py::arg("nbytes"), py::arg("owner") = 0,
            "Register [start, start + nbytes). Raises ValueError if it overlaps a registered range.")
        .def(
            "add_many",
            [](RangeRegistry& r, py::iterable items) {
                std::vector<RangeEntry> entries;
                for (py::handle item : items) {
                    py::tuple t = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
                    if (t.size() != 3) throw py::value_error("add_many takes (start, nbytes, owner) triples");
                    const std::uint64_t s = checked_int("start", t[0], 1);
                    const std::uint64_t n = checked_int("nbytes", t[1], 1);
                    const std::uint64_t o = checked_int("owner", t[2], 0);
                    check_range_end(s, n);
                    entries.push_back(RangeEntry{s, s + (n - 1), o});
                }
                py::gil_scoped_release unlocked;
                r.add_many(std::move(entries));
            },
            py::arg("items"),
            "Register many (start, nbytes, owner) ranges with one rebuild; all or nothing. Not in the reference API: "
            "it exists so benchmarks can populate a million ranges quickly.")
        .def(
            "remove",
            [](RangeRegistry& r, py::handle start) {
                std::uint64_t s = 0;
                if (!to_u64(start.ptr(), s)) return false;
                return r.remove(s);
            },
            py::arg("start"), "Drop the range that begins exactly at start. Returns False if there is none.")
        .def(
            "remove_many",
            [](RangeRegistry& r, py::iterable starts) {
                std::vector<std::uint64_t> v;
                for (py::handle s : starts) {
                    std::uint64_t x = 0;
                    if (to_u64(s.ptr(), x)) v.push_back(x);
                }
                py::gil_scoped_release unlocked;
                return r.remove_many(std::move(v));
            },
            py::arg("starts"),
            "Drop every range beginning at one of starts with one rebuild; returns how many were removed. Not in "
            "the reference API (the counterpart of add_many).")
        .def(
            "find",
            [](const RangeRegistry& r, py::handle ptr) -> py::object {
                std::uint64_t p = 0;
                if (!PyLong_Check(ptr.ptr())) throw py::type_error("ptr must be an int");
                if (!to_u64(ptr.ptr(), p)) return py::none();
                auto e = r.find(p);
                return e ? make_range(*e) : py::none();
            },
            py::arg("ptr"), "The range containing address ptr, or None.")
        .def(
            "contains", [](const RangeRegistry& r, py::handle ptr, py::handle nbytes) { return registry_contains(r, ptr.ptr(), nbytes.ptr()); },
            py::arg("ptr"), py::arg("nbytes"), "True iff [ptr, ptr + nbytes) lies inside one registered range.")
        .def(
            "ranges",
            [](const RangeRegistry& r) {
                py::list out;
                for (const RangeEntry& e : r.ranges()) out.append(make_range(e));
                return out;
            },
            "A sorted snapshot of every registered range.")
        .def("total_bytes", &RangeRegistry::total_bytes)
        .def("clear", &RangeRegistry::clear, "Remove every range; returns how many there were.")
        .def("retired_pending", &RangeRegistry::retired_pending,
             "Retired snapshots not yet reclaimed (diagnostics: stays small unless a reader is stuck).")
        .def("__len__", &RangeRegistry::size)
        .def("__contains__", [](const RangeRegistry& r, py::tuple extent) {
            if (extent.size() != 2) throw py::value_error("expected a (ptr, nbytes) extent");
            return registry_contains(r, extent[0].ptr(), extent[1].ptr());
        });

    m.def(
        "global_registry", []() { return &RangeRegistry::global(); }, py::return_value_policy::reference,
        "The process-wide registry optimized's native pinning registers into (never destroyed).");
    if (PyModule_AddFunctions(m.ptr(), g_fast_methods) != 0) throw py::error_already_set();
    m.def(
        "set_is_pinned_fallback",
        [](py::object fallback) {
            PyObject* old = g_is_pinned_fallback;
            g_is_pinned_fallback = fallback.release().ptr();
            Py_XDECREF(old);
        },
        py::arg("fallback"), "Install fallback(t, hit) for is_pinned calls the registry does not answer.");
    m.def(
        "set_miss_answer",
        [](py::object env_value, bool torch_pinning, bool cuda_pointers) {
            // Called by optimized.pinning under the GIL after resolving the accelerator for this variable value.
            if (g_name_is_pinned == nullptr) {
                g_name_is_pinned = PyUnicode_InternFromString("is_pinned");
                if (!g_name_is_pinned) throw py::error_already_set();
            }
            g_miss_cuda_pointers = cuda_pointers;
            g_miss_env_set = !env_value.is_none();
            g_miss_env = g_miss_env_set ? env_value.cast<std::string>() : std::string();
            g_miss_torch_pinning = torch_pinning;
            g_miss_generation = fork_generation();
            g_miss_known = true;
        },
        py::arg("env_value"), py::arg("torch_pinning"), py::arg("cuda_pointers") = false,
        "Cache, for this value of HOSTOFFLOAD_ACCELERATOR (None: unset), whether the accelerator has torch "
        "pinning and whether the CUDA runtime may be asked about a pointer directly (the stock CUDA accelerator), "
        "so is_pinned answers registry misses without calling back into Python.");
    m.def("forget_miss_answer", []() { g_miss_known = false; },
          "Drop the cached miss answer (the next miss goes through the Python fallback).");
    m.def(
        "set_tensor_types",
        [](py::object tensor, py::object parameter, py::object strided) {
            if (g_tensor_type != nullptr) return;  // set once per process
            // Kept for the life of the process (the fast path may run during shutdown).
            g_tensor_type = tensor.release().ptr();
            g_parameter_type = parameter.release().ptr();
            g_strided = strided.release().ptr();
            g_name_layout = PyUnicode_InternFromString("layout");
            g_name_is_cpu = PyUnicode_InternFromString("is_cpu");
            g_name_data_ptr = PyUnicode_InternFromString("data_ptr");
            g_name_is_contiguous = PyUnicode_InternFromString("is_contiguous");
            g_name_nbytes = PyUnicode_InternFromString("nbytes");
            if (!g_name_is_cpu || !g_name_data_ptr || !g_name_is_contiguous || !g_name_nbytes || !g_name_layout) {
                throw py::error_already_set();
            }
        },
        py::arg("tensor"), py::arg("parameter"), py::arg("strided"),
        "Tell the is_pinned fast path which types are plain tensors (torch.Tensor, torch.nn.Parameter) and which "
        "object is torch.strided.");
    m.def(
        "cuda_host_pointer_pinned",
        [](py::handle ptr) {
            std::uint64_t p = 0;
            if (!to_u64(ptr.ptr(), p)) throw py::type_error("ptr must be an int >= 0");
            return CudaHostApi::host_pointer_pinned(reinterpret_cast<const void*>(p));
        },
        py::arg("ptr"),
        "1/0: the CUDA runtime torch loaded reports ptr as page-locked host memory or not; -1: it cannot be asked "
        "here without side effects (no runtime loaded, no active context on the current device, an error).");

    // ---- native allocations ---------------------------------------------------------------------------------
    py::class_<Allocation, std::shared_ptr<Allocation>>(m, "NativeAllocation", R"doc(
One native pinned allocation. Python only holds it between allocate() and export(); after that the DLPack tensor
owns it, and the memory is released when the last view of that tensor dies.)doc")
        .def_property_readonly("id", &Allocation::id)
        .def_property_readonly("data", &Allocation::data)
        .def_property_readonly("size", &Allocation::size)
        .def_property_readonly("pinned", &Allocation::pinned)
        .def_property_readonly("registered", &Allocation::registered)
        .def_property_readonly("is_slab", &Allocation::is_slab)
        .def_property_readonly("page_kind", &Allocation::page_kind)
        .def_property_readonly("register_error", &Allocation::register_error)
        .def_property_readonly("phase_seconds",
                               [](const Allocation& a) {
                                   const double* s = a.phase_seconds();
                                   py::dict d;
                                   d["map"] = s[0];
                                   d["populate"] = s[1];
                                   d["lock"] = s[2];
                                   d["register"] = s[3];
                                   d["registry"] = s[4];
                                   return d;
                               })
        .def(
            "export", [](std::shared_ptr<Allocation> a) { return export_dlpack(std::move(a)); },
            "A 'dltensor' capsule: uint8[size] over the whole allocation (torch.from_dlpack consumes it).")
        .def(
            "unpin",
            [](Allocation& a) {
                Allocation::UnpinResult r;
                {
                    py::gil_scoped_release unlocked;
                    r = a.unpin();
                }
                return unpin_outcome(r) == 1;
            },
            "Drop the range, unregister and munlock now; the mapping stays until the last view dies.")
        .def(
            "set_external_registration",
            [](std::shared_ptr<Allocation> a, py::object unregister) {
                // Called exactly once, before munlock, from unpin or from the last view's deleter (any thread).
                PyObject* fn = unregister.release().ptr();
                const unsigned long long ptr = a->data();
                // The allocation's mutex is never taken while holding the GIL (the hook takes the GIL while
                // holding the mutex), so release it first.
                py::gil_scoped_release unlocked;
                a->set_external_registration([fn, ptr](bool may_fail) -> bool {
                    if (!interpreter_alive()) return true;  // shutdown: the process is going away, leak fn
                    PyGILState_STATE st = PyGILState_Ensure();
                    PyObject* r = PyObject_CallFunction(fn, "K", ptr);
                    if (r == nullptr && may_fail) {
                        // unpin(): keep fn for a retry and hand the error to the caller's thread.
                        stash_hook_error();
                        PyGILState_Release(st);
                        return false;
                    }
                    if (r == nullptr) {
                        PyErr_WriteUnraisable(fn);  // last view gone: nobody to raise to, the release goes on
                    } else {
                        Py_DECREF(r);
                    }
                    Py_DECREF(fn);
                    PyGILState_Release(st);
                    return true;
                });
            },
            py::arg("unregister"),
            "Record that an accelerator hook registered this allocation; unregister(ptr) undoes it later.");

    m.def(
        "allocate",
        [](std::size_t nbytes, const std::string& huge_pages, int populate_threads, bool register_cuda,
           unsigned cuda_flags, bool slab, bool overlap_register) {
            AllocRequest req;
            req.nbytes = nbytes;
            req.huge_pages = parse_huge_pages(huge_pages);
            req.populate_threads = populate_threads;
            req.register_cuda = register_cuda;
            req.cuda_flags = cuda_flags;
            req.slab = slab;
            req.overlap_register = overlap_register;
            py::gil_scoped_release unlocked;  // faulting in gigabytes must not stall other Python threads
            return Allocation::create(req);
        },
        py::arg("nbytes"), py::arg("huge_pages") = "auto", py::arg("populate_threads") = 0,
        py::arg("register_cuda") = false, py::arg("cuda_flags") = 0, py::arg("slab") = false,
        py::arg("overlap_register") = false,
        "Map, lock, populate (in parallel), optionally register with CUDA, and add to the global registry.");

    m.def(
        "allocation_of",
        [](py::handle ptr, py::handle nbytes) -> std::shared_ptr<Allocation> {
            std::uint64_t p = 0;
            std::uint64_t n = 0;
            if (!to_u64(ptr.ptr(), p) || p == 0 || !to_u64(nbytes.ptr(), n)) return nullptr;
            RangeRegistry& reg = RangeRegistry::global();
            if (!reg.contains(p, n)) return nullptr;
            auto e = reg.find(p);
            return e ? Allocation::lookup(e->owner) : nullptr;
        },
        py::arg("ptr"), py::arg("nbytes"),
        "The live pinned allocation whose range holds the whole extent, or None.");

    m.def(
        "unpin_extent",
        [](py::handle ptr, py::handle nbytes) -> int {
            std::uint64_t p = 0;
            std::uint64_t n = 0;
            if (!to_u64(ptr.ptr(), p) || p == 0 || !to_u64(nbytes.ptr(), n)) return 0;
            int code = 0;  // 0: nothing to unpin, -1: a slab piece, 2: unpin() ran and `result` says how
            Allocation::UnpinResult result = Allocation::UnpinResult::kNotPinned;
            {
                py::gil_scoped_release unlocked;
                RangeRegistry& reg = RangeRegistry::global();
                if (reg.contains(p, n)) {
                    auto e = reg.find(p);
                    std::shared_ptr<Allocation> a = e ? Allocation::lookup(e->owner) : nullptr;
                    if (a && a->is_slab()) {
                        code = -1;
                    } else if (a) {
                        result = a->unpin();
                        code = 2;
                    }
                }
            }
            return code == 2 ? unpin_outcome(result) : code;
        },
        py::arg("ptr"), py::arg("nbytes"),
        "Unpin the allocation holding the extent: 1 if this call unpinned it, 0 if nothing to unpin, -1 if the "
        "extent belongs to a slab (pieces are freed through the slab).");

    m.def(
        "pinned_counters",
        []() {
            const PinnedCounters c = pinned_counters();
            return py::make_tuple(c.allocations, c.bytes, c.registered_bytes, c.unpinned_alive, c.release_errors);
        },
        "(allocations, bytes, registered_bytes, unpinned_alive, release_errors) of native allocations.");
    m.def("dlpack_exports_alive", &dlpack_exports_alive);
    m.def("fork_generation", &fork_generation,
          "How many fork()s separate this process from the one that loaded the module first (0 there); "
          "allocations of an earlier generation are inherited and not pinned here (docs/native.md, fork()).");
    m.def("page_size", &host_page_size);
    m.def("cuda_runtime_available", &CudaHostApi::available,
          "True if a CUDA runtime could be found (already loaded by torch, or by soname).");
    m.def("cuda_runtime_describe", &CudaHostApi::describe, "Where the CUDA runtime came from, or why it did not.");
    m.attr("CUDA_HOST_REGISTER_PORTABLE") = CudaHostApi::kRegisterPortable;
    m.attr("CUDA_HOST_REGISTER_MAPPED") = CudaHostApi::kRegisterMapped;

    // ---- CPU Adam kernels (bind_cpu_adam.cpp) ------------------------------------------------------------
    py::module_ cpu_adam = m.def_submodule(
        "cpu_adam", "Native CPU Adam/AdamW (R16 arithmetic, runtime ISA dispatch); use optimized.cpu_adam, not this.");
    bind_cpu_adam(cpu_adam);

    // ---- slab arena -----------------------------------------------------------------------------------------
    py::class_<SlabStats>(m, "SlabArenaStats")
        .def_readonly("capacity", &SlabStats::capacity)
        .def_readonly("used", &SlabStats::used)
        .def_readonly("free", &SlabStats::free)
        .def_readonly("largest_free", &SlabStats::largest_free)
        .def_readonly("pieces", &SlabStats::pieces)
        .def_readonly("free_blocks", &SlabStats::free_blocks);
    py::class_<SlabArena>(m, "SlabArena", "First-fit offset allocator with coalescing (see optimized.slab).")
        .def(py::init<std::size_t>(), py::arg("capacity"))
        .def("allocate", &SlabArena::allocate, py::arg("nbytes"), py::arg("alignment"),
             "Offset of a new piece, or None if no free run fits.")
        .def("release", &SlabArena::release, py::arg("offset"), "Free the piece at offset; False if none starts there.")
        .def("piece_size", &SlabArena::piece_size, py::arg("offset"))
        .def("stats", &SlabArena::stats)
        .def("reset", &SlabArena::reset);
}

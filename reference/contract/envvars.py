"""Every ``HOSTOFFLOAD_*`` environment variable: its name, allowed values, default, and the one parsing rule.

Why this is contract: a variable means the same thing whichever implementation reads it. ``HOSTOFFLOAD_PIN_BACKEND``
set for a training job must select the same backend, reject the same typos with the same error, and accept the
same spellings under ``reference`` and ``optimized``; the conformance suite sets these variables to drive either
implementation. So each variable is declared once, here, with its parser; implementations call the parser and
never read ``os.environ`` for a ``HOSTOFFLOAD_*`` name themselves (a structural test checks that no other module of
``reference/`` or ``optimized/`` spells one). :data:`VARIABLES` lists every variable of the project, including the
ones read by the native extension, the conformance harness, the benchmarks and the build, so that this module is
the one place to look; ``conformance.selftest.test_contract_layout`` fails when a ``HOSTOFFLOAD_*`` name appears
anywhere in the source tree without being declared here.

Names: the constant of ``HOSTOFFLOAD_<X>`` is ``<X>_ENV`` (``PIN_BACKEND_ENV``), and the parser an implementation
calls is ``<x>()`` in lower case (``pin_backend()``; ``accelerator_name()`` for the accelerator, whose object
comes from the registry).

Variables are read at each use (the first pinning call and every call after, each engine construction ...),
never at import: a bad value must surface where the user uses the feature, with a message naming the variable
and its allowed values, and a test or a launcher may change them between calls.

**One rule for every variable** (issue 19): the value is read with surrounding blanks stripped; unset or blank
means the default; named values (backends, accelerators, modes, booleans, profiles) compare case-insensitively
(``CPU``, ``Native`` and ``ON`` mean ``cpu``, ``native`` and ``on``); numbers are decimal. Anything else is a
:class:`~reference.contract.errors.ConfigurationError` naming the variable and its allowed values. :func:`normalize`
is the rule for named values, :func:`read_int` and :func:`read_number` for numbers; every reader goes through them.

Every pinning variable is validated at every pinning call whatever the backend: a bad
``HOSTOFFLOAD_PIN_REGISTER_DEVICE``, ``..._PIN_HUGE_PAGES``, ``..._PIN_POPULATE_THREADS`` or
``..._PIN_REGISTER_OVERLAP`` is an error with the torch backend too, although only a native path uses them, so a
bad value never waits for the day the backend changes. A *name* that is not declared here (a misspelling such as
``..._PIN_BACKND``) cannot be an error -- another tool may own a name with this prefix -- so the first pinning call
that sees it warns about it, once per process (:class:`UnknownVariableWarning`, naming the closest declared name;
:func:`warn_unknown_variables`).
"""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import overload

from reference.contract.errors import ConfigurationError, allowed_values_error

# -- the rule ---------------------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_VALUES: tuple[str, ...] = ("1", "0", "true", "false", "yes", "no", "on", "off")


def normalize(raw: str | None) -> str | None:
    """The rule for named values: None for unset or blank, else the value stripped and lower-cased."""
    if raw is None:
        return None
    value = raw.strip().lower()
    return value or None


def read_bool(name: str, default: bool) -> bool:
    """Parse a boolean variable: unset or empty -> default; case-insensitive on/off spellings; else an error."""
    raw = os.environ.get(name)
    value = normalize(raw)
    if value is None:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise allowed_values_error(name, raw, BOOL_VALUES)


def read_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Parse an enumerated variable: unset or empty -> default; exact (case-insensitive) match; else an error."""
    raw = os.environ.get(name)
    value = normalize(raw)
    if value is None:
        return default
    if value not in choices:
        raise allowed_values_error(name, raw, choices)
    return value


@overload
def read_int(name: str, minimum: int, default: int, meaning: str = "") -> int: ...
@overload
def read_int(name: str, minimum: int, default: None, meaning: str = "") -> int | None: ...
def read_int(name: str, minimum: int, default: int | None, meaning: str = "") -> int | None:
    """Parse an integer variable: unset or blank -> ``default``; a decimal int >= ``minimum``; else an error whose
    allowed values read ``an int >= minimum`` followed by ``meaning`` (e.g. ``" (0: automatic)"``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigurationError(f"{name}={raw!r} is not allowed; allowed values: an int >= {minimum}{meaning}")
    return value


def read_number(name: str, minimum: float, default: float) -> float:
    """Parse a decimal number: unset or blank -> ``default``; a finite number >= ``minimum``; else an error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = None
    if value is None or not value >= minimum or value == float("inf"):
        raise ConfigurationError(f"{name}={raw!r} is not allowed; allowed values: a number >= {minimum:g}")
    return value


# -- read by every implementation: pinning ------------------------------------------------------------------------

PIN_BACKEND_ENV = "HOSTOFFLOAD_PIN_BACKEND"
PIN_BACKENDS: tuple[str, ...] = ("torch", "native")
DEFAULT_PIN_BACKEND = "torch"

PIN_REGISTER_DEVICE_ENV = "HOSTOFFLOAD_PIN_REGISTER_DEVICE"


def pin_backend() -> str:
    """The pinning backend selected by ``HOSTOFFLOAD_PIN_BACKEND`` (default ``torch``)."""
    return read_choice(PIN_BACKEND_ENV, PIN_BACKENDS, DEFAULT_PIN_BACKEND)


def pin_register_device() -> bool:
    """Whether the native backend registers its pages with the device (``HOSTOFFLOAD_PIN_REGISTER_DEVICE``)."""
    return read_bool(PIN_REGISTER_DEVICE_ENV, True)


def check_pinning_environment() -> str:
    """Validate every pinning variable now, whatever the backend (the native tuning variables below included),
    warn about undeclared ``HOSTOFFLOAD_*`` names; return the selected backend."""
    backend = pin_backend()
    pin_register_device()
    pin_huge_pages()
    pin_populate_threads()
    pin_register_overlap()
    warn_unknown_variables()
    return backend


# -- read by implementations' ZeRO engines: where the engine's own host buffers come from -----------------------

ZERO_HOST_MEMORY_ENV = "HOSTOFFLOAD_ZERO_HOST_MEMORY"
ZERO_HOST_MEMORY_MODES: tuple[str, ...] = ("exact", "pin_backend")


def zero_host_memory() -> str:
    """Where a ZeRO engine's own pinned buffers (offloaded masters, optimizer state, accumulators, stage-3
    partitions) come from (``HOSTOFFLOAD_ZERO_HOST_MEMORY``): ``exact`` (default) page-locks exactly their size
    (page-rounded) and registers it with the accelerator, whatever ``HOSTOFFLOAD_PIN_BACKEND`` selects for user
    tensors; ``pin_backend`` takes them from that backend (``torch``: its caching allocator, which rounds every
    buffer up to a power of two, and does not count against ``ulimit -l``)."""
    return read_choice(ZERO_HOST_MEMORY_ENV, ZERO_HOST_MEMORY_MODES, "exact")


# -- read by every implementation: the accelerator ---------------------------------------------------------------

ACCELERATOR_ENV = "HOSTOFFLOAD_ACCELERATOR"


def accelerator_name() -> str | None:
    """The accelerator ``HOSTOFFLOAD_ACCELERATOR`` names, normalised (None: unset or blank). The registry
    (:func:`reference.contract.accelerators.get_accelerator`) matches it case-insensitively against the installed
    names and raises for a name no package provides."""
    return normalize(os.environ.get(ACCELERATOR_ENV))


# -- tuning of a native pinning path (only a native path uses them; every pinning call validates them) -----------

PIN_HUGE_PAGES_ENV = "HOSTOFFLOAD_PIN_HUGE_PAGES"
PIN_HUGE_PAGES_MODES: tuple[str, ...] = ("auto", "thp", "hugetlb", "off")
PIN_POPULATE_THREADS_ENV = "HOSTOFFLOAD_PIN_POPULATE_THREADS"
PIN_REGISTER_OVERLAP_ENV = "HOSTOFFLOAD_PIN_REGISTER_OVERLAP"


def pin_huge_pages() -> str:
    """How native pinned buffers use huge pages (``HOSTOFFLOAD_PIN_HUGE_PAGES``, default ``auto``)."""
    return read_choice(PIN_HUGE_PAGES_ENV, PIN_HUGE_PAGES_MODES, "auto")


def pin_populate_threads() -> int:
    """Threads faulting in a fresh native buffer (``HOSTOFFLOAD_PIN_POPULATE_THREADS``; 0, the default: auto)."""
    value = read_int(PIN_POPULATE_THREADS_ENV, 0, 0, " (0: automatic)")
    return 0 if value is None else value


def pin_register_overlap() -> bool:
    """Whether device registration overlaps page population (``HOSTOFFLOAD_PIN_REGISTER_OVERLAP``, default on)."""
    return read_bool(PIN_REGISTER_OVERLAP_ENV, True)


# -- tuning of a native CPU optimizer (optional) -----------------------------------------------------------------

CPU_ADAM_THREADS_ENV = "HOSTOFFLOAD_CPU_ADAM_THREADS"


def cpu_adam_threads() -> int | None:
    """Threads of the native CPU Adam step (``HOSTOFFLOAD_CPU_ADAM_THREADS``, an int >= 1; None when unset: the
    caller then uses the cores this process may run on)."""
    return read_int(CPU_ADAM_THREADS_ENV, 1, None)


# -- which kernel steps an Adam master on a device (optional) ------------------------------------------------------

STAGING_ELEMENTS_ENV = "HOSTOFFLOAD_STAGING_ELEMENTS"
#: The default of :data:`STAGING_ELEMENTS_ENV`: 16 Mi elements (64 MiB per fp32 slot).
DEFAULT_STAGING_ELEMENTS = 16 * 2**20


def staging_elements() -> int:
    """Elements per staging slot of a device run's streamed gradient (the slots a bucket's running sum passes
    through in chunks; a smaller value spends less device memory, more copies). Read at engine construction."""
    return read_int(STAGING_ELEMENTS_ENV, 1, DEFAULT_STAGING_ELEMENTS)


MIDDLE_BACKWARDS_ENV = "HOSTOFFLOAD_MIDDLE_BACKWARDS"
MIDDLE_BACKWARDS_MODES: tuple[str, ...] = ("device", "host")


def middle_backwards() -> str:
    """Where a device run's streamed update adds the gradients of an accumulation's middle backwards (neither its
    first nor its last) into the running sum (``HOSTOFFLOAD_MIDDLE_BACKWARDS``): ``device`` (default) brings the
    sum up and sends it back per backward; ``host`` sends the gradient down at the comm dtype's width and adds it
    on the host (issue 49 item 4; the same bits either way). ``host`` stays opt-in until its run on a GPU is
    measured and checked. Read at engine construction."""
    return read_choice(MIDDLE_BACKWARDS_ENV, MIDDLE_BACKWARDS_MODES, "device")


DEVICE_ADAM_ENV = "HOSTOFFLOAD_DEVICE_ADAM"
DEVICE_ADAM_MODES: tuple[str, ...] = ("auto", "fused", "torch")


def device_adam() -> str:
    """How an implementation steps an Adam/AdamW fp32 master that lives on a device
    (``HOSTOFFLOAD_DEVICE_ADAM``): ``auto`` (default) a fused one-pass kernel where the implementation has one and
    it matches the torch-op sequence bitwise on that device, else torch ops; ``fused`` requires the kernel (an
    error where it is missing or fails its check); ``torch`` the torch-op sequence. Every choice computes the same
    bits; only the time differs."""
    return read_choice(DEVICE_ADAM_ENV, DEVICE_ADAM_MODES, "auto")


# -- read by the conformance harness (they configure the judge, not the judged; parsed by their readers) ---------

ACCUMULATION_BACKEND_ENV = "HOSTOFFLOAD_ACCUMULATION_BACKEND"
ACCUMULATION_TIMEOUT_ENV = "HOSTOFFLOAD_ACCUMULATION_TIMEOUT"
ACCUMULATION_POOL_SIZE_ENV = "HOSTOFFLOAD_ACCUMULATION_POOL_SIZE"
ISOLATED_REPORTS_ENV = "HOSTOFFLOAD_ISOLATED_REPORTS"
ISOLATION_ZYGOTE_ENV = "HOSTOFFLOAD_ISOLATION_ZYGOTE"
HYPOTHESIS_PROFILE_ENV = "HOSTOFFLOAD_HYPOTHESIS_PROFILE"
SOURCE_ROOT_ENV = "HOSTOFFLOAD_SOURCE_ROOT"
IO_NO_O_DIRECT_DIR_ENV = "HOSTOFFLOAD_IO_NO_O_DIRECT_DIR"

# -- read by the benchmarks and the build (declared so that this list is complete) --------------------------------

BENCH_IO_DIR_ENV = "HOSTOFFLOAD_BENCH_IO_DIR"
BENCH_IO_JSON_ENV = "HOSTOFFLOAD_BENCH_IO_JSON"
BENCH_IO_MIB_ENV = "HOSTOFFLOAD_BENCH_IO_MIB"
TORCH_SPEC_ENV = "HOSTOFFLOAD_TORCH_SPEC"


# -- the list ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    """One ``HOSTOFFLOAD_*`` variable: who reads it, what it accepts, what unset means."""

    name: str
    reader: str
    allowed: str
    default: str
    meaning: str


#: Readers, in the order the table lists them.
READERS: tuple[str, ...] = (
    "implementations",
    "native pinning",
    "native optimizer",
    "conformance",
    "benchmarks",
    "build",
)

_BOOL = "1 0 true false yes no on off"

#: Every ``HOSTOFFLOAD_*`` variable of the project (docs/usage.md shows the same table).
VARIABLES: tuple[Variable, ...] = (
    Variable(PIN_BACKEND_ENV, "implementations", "torch, native", DEFAULT_PIN_BACKEND, "pinning backend"),
    Variable(PIN_REGISTER_DEVICE_ENV, "implementations", _BOOL, "on", "native backend registers pages with the device"),
    Variable(
        ACCELERATOR_ENV,
        "implementations",
        "an installed accelerator (cpu, cuda, a vendor's)",
        "first available non-cpu that may be a default, else cpu",
        "the accelerator every call uses (the native is_pinned cache keys on it too, csrc/module.cpp)",
    ),
    Variable(
        ZERO_HOST_MEMORY_ENV, "implementations", ", ".join(ZERO_HOST_MEMORY_MODES), "exact",
        "where a ZeroEngine's own pinned buffers come from (exact: page-locked at their size)",
    ),
    Variable(
        STAGING_ELEMENTS_ENV, "implementations", "an int >= 1", str(DEFAULT_STAGING_ELEMENTS),
        "elements per staging slot of a device run's streamed gradient",
    ),
    Variable(
        MIDDLE_BACKWARDS_ENV, "implementations", ", ".join(MIDDLE_BACKWARDS_MODES), "device",
        "where a device run adds the gradients of an accumulation's middle micro-batches",
    ),
    Variable(PIN_HUGE_PAGES_ENV, "native pinning", ", ".join(PIN_HUGE_PAGES_MODES), "auto", "huge pages of buffers"),
    Variable(PIN_POPULATE_THREADS_ENV, "native pinning", "an int >= 0 (0: automatic)", "0", "page-population threads"),
    Variable(PIN_REGISTER_OVERLAP_ENV, "native pinning", _BOOL, "on", "register with the device while populating"),
    Variable(CPU_ADAM_THREADS_ENV, "native optimizer", "an int >= 1", "the cores this process may use", "CPU Adam"),
    Variable(DEVICE_ADAM_ENV, "native optimizer", ", ".join(DEVICE_ADAM_MODES), "auto", "Adam on device masters"),
    Variable(ACCUMULATION_BACKEND_ENV, "conformance", "gloo, nccl, auto", "gloo", "transport of the rank pool"),
    Variable(ACCUMULATION_TIMEOUT_ENV, "conformance", "a number >= 1 (seconds)", "60", "collective timeout"),
    Variable(ACCUMULATION_POOL_SIZE_ENV, "conformance", "a number >= 1", "4", "ranks the host pool starts with"),
    Variable(ISOLATED_REPORTS_ENV, "conformance", "a file path (set by the harness)", "unset", "child test reports"),
    Variable(ISOLATION_ZYGOTE_ENV, "conformance", "READ_FD,WRITE_FD (set by the harness)", "unset", "zygote pipes"),
    Variable(
        HYPOTHESIS_PROFILE_ENV,
        "conformance",
        "dev, ci, conformance, gpu, thorough",
        "ci under $CI, else dev",
        "hypothesis profile",
    ),
    Variable(SOURCE_ROOT_ENV, "conformance", "a checkout's root", "the installed package's parent", "source tests"),
    Variable(IO_NO_O_DIRECT_DIR_ENV, "conformance", "a directory", "/dev/shm, /run/shm, /run", "O_DIRECT refusal"),
    Variable(BENCH_IO_DIR_ENV, "benchmarks", "a directory", "a temporary directory", "bench_io files"),
    Variable(BENCH_IO_JSON_ENV, "benchmarks", "a file path", "unset (no JSON)", "bench_io results"),
    Variable(BENCH_IO_MIB_ENV, "benchmarks", "an int >= 1", "bench_io's size", "bench_io tensor MiB"),
    Variable(TORCH_SPEC_ENV, "build", "a pip version spec", "==2.13.0", "torch tox installs"),
)

#: Names by variable, for lookups and the structural test.
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


# -- names that are not declared -------------------------------------------------------------------------------

PREFIX = "HOSTOFFLOAD_"


class UnknownVariableWarning(UserWarning):
    """A ``HOSTOFFLOAD_*`` variable is set that this contract does not declare (most likely a misspelling)."""


def closest_variable(name: str) -> str | None:
    """The declared name most like ``name`` (None when nothing is close)."""
    match = difflib.get_close_matches(name, BY_NAME, n=1, cutoff=0.6)
    return match[0] if match else None


#: The undeclared names already warned about in this process (each is warned about once; see
#: warn_unknown_variables).
_warned: set[str] = set()
_warned_lock = threading.Lock()


def unknown_variables() -> tuple[str, ...]:
    """The ``HOSTOFFLOAD_*`` names set in the environment that :data:`VARIABLES` does not declare."""
    return tuple(sorted(k for k in os.environ if k.startswith(PREFIX) and k not in BY_NAME))


def warn_unknown_variables() -> tuple[str, ...]:
    """Warn (:class:`UnknownVariableWarning`) once per process for each undeclared ``HOSTOFFLOAD_*`` name set now,
    naming the closest declared one; return every such name set now (warned about before or not).

    Why a warning and not an error: the prefix is not reserved, and refusing to pin memory because of an unrelated
    variable would be worse than the typo. Why once per process and name (issue 52): every pinning call checks, an
    engine's construction and first step make several, and Python's default filter shows a message once per
    call site, so one typo printed three or more identical lines; a name set later in the process (a launcher
    changing the environment) still gets its own warning. The scan reads the environment at every call (a few
    microseconds): a name set or removed between two calls is seen at the next."""
    found = unknown_variables()
    with _warned_lock:
        fresh = [n for n in found if n not in _warned]
        _warned.update(fresh)
    for name in fresh:
        close = closest_variable(name)
        hint = f"did you mean {close}?" if close else "no declared variable is close"
        warnings.warn(
            f"{name} is set but is not a hostoffload variable ({hint}); it is ignored (warned once per process). "
            f"Declared variables: reference/contract/envvars.py (VARIABLES) and docs/usage.md",
            UnknownVariableWarning,
            stacklevel=3,
        )
    return found

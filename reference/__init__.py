"""hostoffload's reference implementation: the executable specification.

Every behaviour here is written to be obviously correct rather than fast; the optimized implementation and any
third-party one are checked against it by the conformance suite. Two layers live here (docs/architecture.md):

- :mod:`reference.contract`: what every implementation shares and must agree on (errors, environment variables,
  configs, the accelerator interface and registry, capabilities, argument checks, stats types, on-disk formats,
  the implementation descriptor). Implementations import it; it imports nothing else of ``reference``.
- the oracles, one package per area (:mod:`reference.pinning`, :mod:`reference.ranges`, :mod:`reference.offload`,
  :mod:`reference.accumulation`, :mod:`reference.io`), written only against the contract. No implementation
  imports them: a bug in shared machinery would be invisible to the comparison the suite exists for.

The error classes (:mod:`reference.errors`, the contract's list) are importable from here as from ``optimized``.
The pinning API below is loaded on first use, so that importing a contract module (as ``optimized`` does) does
not import the pinning oracle with it.
"""


from __future__ import annotations

from typing import Any

from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation
from reference.errors import *  # noqa: F403  (the error classes, for `except reference.ConfigurationError`)
from reference.errors import __all__ as _errors_all

__version__ = "0.1.0"

#: The pinning API, imported from :mod:`reference.pinning` on first use (``__getattr__`` below).
_PINNING_API = frozenset({
    "PinnedStats",
    "is_pinned",
    "pin_empty",
    "pin_empty_like",
    "pin_memory",
    "pinned_stats",
    "unpin",
})

__all__ = [*_errors_all, "IMPLEMENTATION", *sorted(_PINNING_API)]

#: Registered under the ``hostoffload.implementations`` entry point as ``reference``.
IMPLEMENTATION = Implementation(
    name="reference",
    version=__version__,
    areas={
        "pinning": "reference.pinning",
        "ranges": "reference.ranges",
        "offload": "reference.offload",
        "accumulation": "reference.accumulation",
        "io": "reference.io",
        "optimizer_kernels": "reference.optimizer_kernels",
    },
    capabilities=Capabilities(
        pin_backends=("torch", "native"),
        # The reference registry takes one lock per call; the suite sizes its contention test accordingly.
        concurrent_registry_reads=False,
        # The oracle of R27 (docs/accumulation.md): the delayed update, swapped in at the next boundary.
        accumulation_delayed_parameter_update=True,
        # The oracle of R28: the optimizer step of each partition cut between the device and the host.
        accumulation_split_update=True,
        # The oracle of R29: Adam's moments stored in bf16, rounded by the contract's round_to_bf16.
        accumulation_state_precision=True,
        # R30 (host_update_start): the oracle computes "last_backward" as "step" -- its arithmetic is the spec.
        accumulation_overlapped_update=True,
        # Pure Python over torch and the shared native pinning core: the crash-isolation self-test
        # (conformance.selftest) shows a native abort is caught in a child; the suite runs these tests in-process
        # for speed, and the lifetime probes marked ``isolated`` still run in a child.
        crash_isolation=False,
    ),
)


def __getattr__(name: str) -> Any:
    """``reference.pin_empty`` and the rest of the pinning API, imported from :mod:`reference.pinning` on first use."""
    if name in _PINNING_API:
        import reference.pinning as pinning

        value = getattr(pinning, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reference' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _PINNING_API)

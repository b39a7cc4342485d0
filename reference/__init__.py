"""hostoffload's reference implementation: the executable specification.

Every behaviour here is written to be obviously correct rather than fast; the optimized implementation and any
third-party one are checked against it by the conformance suite. This package also owns the shared contracts:
the accelerator interface (:mod:`reference.contract.accelerators`), the errors (:mod:`reference.contract.errors`), the environment
variables (:mod:`reference.contract.envvars`) and the implementation descriptor (:mod:`reference.contract.implementation`).
"""

from __future__ import annotations

from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation
from reference.pinning import PinnedStats, is_pinned, pin_empty, pin_empty_like, pin_memory, pinned_stats, unpin

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATION",
    "PinnedStats",
    "is_pinned",
    "pin_empty",
    "pin_empty_like",
    "pin_memory",
    "pinned_stats",
    "unpin",
]

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
    },
    capabilities=Capabilities(
        pin_backends=("torch", "native"),
        # The reference registry takes one lock per call; the suite sizes its contention test accordingly.
        concurrent_registry_reads=False,
        # Pure Python over torch and the shared native pinning core: the crash-isolation self-test
        # (conformance.selftest) shows a native abort is caught in a child; the suite runs these tests in-process
        # for speed, and the lifetime probes marked ``isolated`` still run in a child.
        crash_isolation=False,
    ),
)

"""hostoffload's optimized implementation: the one to import in training.

It mirrors :mod:`reference` module by module (same names, arguments, errors and environment variables) and is
checked against it by the conformance suite. Native parts come from ``optimized._native`` (built from ``csrc/`` by
the package build; it links neither CUDA nor torch, so this package imports on machines without either).
"""

from __future__ import annotations

from optimized.errors import *  # noqa: F403  (the error classes, for `except optimized.ConfigurationError`)
from optimized.errors import __all__ as _errors_all
from optimized.pinning import PinnedStats, is_pinned, pin_empty, pin_empty_like, pin_memory, pinned_stats, unpin
from reference.implementation import Implementation

__version__ = "0.1.0"

__all__ = [
    *_errors_all,
    "IMPLEMENTATION",
    "PinnedStats",
    "is_pinned",
    "pin_empty",
    "pin_empty_like",
    "pin_memory",
    "pinned_stats",
    "unpin",
]

#: Registered under the ``hostoffload.implementations`` entry point as ``optimized``.
IMPLEMENTATION = Implementation(
    name="optimized",
    version=__version__,
    areas={
        "pinning": "optimized.pinning",
        "ranges": "optimized.ranges",
        "offload": "optimized.offload",
        "io": "optimized.io",
        "accumulation": "optimized.accumulation",
    },
    capabilities={
        "pin_backends": ("torch", "native"),
        # Registry lookups read an immutable published snapshot; only writers take a lock.
        "concurrent_registry_reads": True,
        # optimized.slab.PinnedSlab: one pinned allocation handed out in pieces, each recognised by is_pinned.
        "pinned_slab": "optimized.slab",
        # Reductions add the W owned slices in rank order, so traces equal the reference's at any world size.
        "accumulation_rank_ordered_reduction": True,
        # Tuning environments the native pinning path must be correct under: the CUDA pinning tests repeat their
        # registration and DMA checks with each (registration overlapped with population, and sequential).
        "pin_env_variants": (
            {"HOSTOFFLOAD_PIN_REGISTER_OVERLAP": "1"},
            {"HOSTOFFLOAD_PIN_REGISTER_OVERLAP": "0"},
        ),
    },
)

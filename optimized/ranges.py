"""The process-wide pinned-range registry, in native code (optimized counterpart of :mod:`reference.ranges`).

Same rule, same API, same errors as the reference: an extent ``[ptr, ptr + nbytes)`` is pinned iff it lies
entirely inside ONE registered range (straddling two adjacent ranges is not pinned; a zero-length extent is
pinned iff its address is inside a range). What changes is the cost model:

- lookups are two binary searches over an immutable snapshot and never take a lock, so copy engines, swap
  handles and offload pools on many threads can ask at once without serialising (``is_pinned`` at a million
  live ranges stays well under a microsecond from Python);
- ``add``/``remove`` copy only the small chunk they change plus the top-level index and serialise on a writer
  mutex; old snapshots are reclaimed once no reader can still see them.

:func:`global_registry` is the one instance per process that :mod:`optimized.pinning`'s native backend
registers into. It is separate from the reference's (each implementation answers for its own allocations).

Differences from the reference, all deliberate: addresses and sizes are 64-bit (a range past ``2**64`` is a
``ConfigurationError`` rather than a silently stored big integer); ``add_many``/``remove_many`` change many
ranges with one rebuild (benchmarks register a million); :func:`stress_registry` is a native self-test, present in
test builds only (``optimized._native_testing``, CMake option ``HOSTOFFLOAD_TEST_EXTENSIONS``, which tox's package
build turns on).
"""

from __future__ import annotations

from types import ModuleType

import torch

from optimized import _native
from reference.contract.pinning_rules import PinnedRange

__all__ = [
    "PinnedRange",
    "RangeRegistry",
    "extent_is_registered",
    "global_registry",
    "stress_registry",
    "tensor_extent",
]

#: Native registry class: ``add(start, nbytes, owner=0)``, ``remove(start)``, ``find(ptr)``,
#: ``contains(ptr, nbytes)``, ``ranges()``, ``total_bytes()``, ``len()``, ``(ptr, nbytes) in registry``, plus
#: ``add_many(triples)`` and ``clear()``.
RangeRegistry = _native.RangeRegistry

_GLOBAL_REGISTRY = _native.global_registry()


def global_registry() -> RangeRegistry:
    """The process-wide registry that optimized's native pinning backend registers into."""
    return _GLOBAL_REGISTRY


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte extent ``(ptr, nbytes)`` a strided tensor can touch; same result as the reference.

    A contiguous tensor's extent is exactly its ``nbytes`` (the element with the largest offset is the last
    one), which avoids walking shape and strides on the common path.
    """
    ptr = t.data_ptr()
    if t.is_contiguous():
        return ptr, t.nbytes
    if t.numel() == 0:
        return ptr, 0
    if t.is_nested:  # strided nested: its components are packed in one buffer of numel elements
        return ptr, t.numel() * t.element_size()
    last = 0
    for size, stride in zip(t.shape, t.stride(), strict=False):
        last += (size - 1) * stride
    return ptr, (last + 1) * t.element_size()


def extent_is_registered(t: torch.Tensor, registry: RangeRegistry | None = None) -> bool:
    """Apply the registry rule to a tensor's extent."""
    ptr, nbytes = tensor_extent(t)
    return (registry or _GLOBAL_REGISTRY).contains(ptr, nbytes)


_native_testing: ModuleType | None
try:  # test builds only (CMake option HOSTOFFLOAD_TEST_EXTENSIONS; tox turns it on): never in the production module
    from optimized import _native_testing
except ImportError:
    _native_testing = None


def stress_registry(readers: int = 4, writers: int = 4, ops_per_writer: int = 20_000) -> dict[str, object]:
    """Self-test of the lock-free read path: native threads read and write a private registry at once.

    From Python every registry call holds the GIL, so readers and writers never truly overlap there; this runs
    ``readers`` native threads probing ranges that stay registered (always found, whole-extent rule included)
    and gaps (never found) while ``writers`` native threads add and remove ranges of their own. Returns counts
    and ``violations`` (0 when correct) with the first one described. A reclamation bug typically crashes the
    process instead, so run it in a subprocess when a crash must be reported rather than suffered.
    """
    assert _native_testing is not None  # a production build deletes this function (below)
    return _native_testing.stress_registry(readers, writers, ops_per_writer)


if _native_testing is None:  # a production build: no stress run to offer (the suite then skips that one test)
    del stress_registry
    __all__.remove("stress_registry")

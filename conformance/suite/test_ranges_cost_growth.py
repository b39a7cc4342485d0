"""Cost-growth properties of the range registry and of ``is_pinned`` (conformance.cost_growth explains the
method): lookups (hit and miss) and removal at 10 vs 100 000 live ranges, as a ratio with a generous bound."""

from __future__ import annotations

import ctypes
import mmap
import random

import pytest
import torch

from conformance.cost_growth import LARGE, MAX_RATIO, SMALL, STRIDE, growth_message, per_call_seconds, per_op_seconds

pytestmark = pytest.mark.conformance_area("ranges")

_PROBES = 2000


def _fill(registry, base: int, n: int) -> list[int]:
    starts = [base + i * STRIDE for i in range(n)]
    for s in starts:  # ascending: cheap for any sorted structure
        registry.add(s, STRIDE // 2)
    return starts


def _measure_registry(registry_cls, n: int, seed: int) -> dict[str, float]:
    registry = registry_cls()
    base = 1 << 40
    starts = _fill(registry, base, n)
    rng = random.Random(seed)
    hits = [s + rng.randrange(STRIDE // 2 - 64) for s in rng.choices(starts, k=_PROBES)]
    misses = [s + STRIDE // 2 + rng.randrange(STRIDE // 2 - 64) for s in rng.choices(starts, k=_PROBES)]
    out = {
        "contains (hit)": per_op_seconds(lambda p: registry.contains(p, 64), hits),
        "contains (miss)": per_op_seconds(lambda p: registry.contains(p, 64), misses),
        "find (hit)": per_op_seconds(registry.find, hits),
    }
    victims = rng.sample(starts, k=min(200, n))

    def setup(s: int) -> int:
        if not registry.contains(s, 1):
            registry.add(s, STRIDE // 2)
        return s

    out["remove"] = per_call_seconds(setup, registry.remove, victims * max(1, 200 // len(victims)))
    return out


def test_registry_lookup_and_remove_cost_is_logarithmic(area_api):
    """contains (hit and miss), find and remove cost about the same with 100 000 live ranges as with 10."""
    small = _measure_registry(area_api.RangeRegistry, SMALL, 1)
    large = _measure_registry(area_api.RangeRegistry, LARGE, 2)
    ratios = {op: large[op] / small[op] for op in small}
    slow = {op: r for op, r in ratios.items() if r > MAX_RATIO}
    assert not slow, "; ".join(growth_message(f"RangeRegistry.{op}", small[op], large[op]) for op in slow)


@pytest.mark.requires(pin_backends="native", areas=("pinning",))
def test_is_pinned_cost_is_logarithmic_in_live_ranges(impl, area_api, accelerator, monkeypatch):
    """is_pinned of a pinned buffer (hit) and of a pageable one (miss) costs about the same with 100 000 other
    live ranges in the process-wide registry as with 10. The extra ranges lie in a reserved, inaccessible
    address range (PROT_NONE), so they can never collide with a real allocation."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")
    pinning = impl.load("pinning")
    registry = area_api.global_registry()
    size = (LARGE + 1) * STRIDE
    base = _reserve(size)
    pinned = pinning.pin_empty(4096, dtype=torch.uint8)
    pageable = torch.empty(4096, dtype=torch.uint8)
    views = [pinned[i : i + 64] for i in range(0, 4096, 64)]
    pageable_views = [pageable[i : i + 64] for i in range(0, 4096, 64)]
    results: dict[int, tuple[float, float]] = {}
    added: list[int] = []
    try:
        for n in (SMALL, LARGE):
            for i in range(len(added), n):
                registry.add(base + i * STRIDE, STRIDE // 2)
                added.append(base + i * STRIDE)
            assert all(pinning.is_pinned(v) for v in views) and not any(pinning.is_pinned(v) for v in pageable_views)
            hit = per_op_seconds(lambda k: pinning.is_pinned(views[k]), list(range(len(views))) * 10)
            miss = per_op_seconds(lambda k: pinning.is_pinned(pageable_views[k]), list(range(len(views))) * 10)
            results[n] = (hit, miss)
    finally:
        for s in added:
            registry.remove(s)
        pinning.unpin(pinned)
        views.clear()
        _release(base, size)
    for k, what in ((0, "is_pinned (hit)"), (1, "is_pinned (miss)")):
        small, large = results[SMALL][k], results[LARGE][k]
        assert large / small <= MAX_RATIO, growth_message(what, small, large)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _reserve(size: int) -> int:
    """Inaccessible address space (PROT_NONE, no memory behind it): addresses no allocation can ever get."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    addr = _libc.mmap(None, size, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap(PROT_NONE) failed")
    return addr


def _release(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        raise OSError(ctypes.get_errno(), "munmap failed")

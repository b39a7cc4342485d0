"""Assertion helpers of the offload suite; failures name the parameter, step and element that differ."""

from __future__ import annotations

import gc

import torch

from conformance.areas.assertions import assert_bitwise_equal, assert_same_layout


def assert_results_bitwise_equal(
    actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None], context: str
) -> None:
    """Same names, and for each name bitwise-equal tensors (or both None: no gradient reached it)."""
    if set(actual) != set(expected):
        raise AssertionError(f"{context}: result names differ: {sorted(actual)} != expected {sorted(expected)}")
    for name in sorted(expected):
        a, e = actual[name], expected[name]
        if (a is None) != (e is None):
            raise AssertionError(
                f"{context}: {name} is {'None' if a is None else 'set'} but expected {'None' if e is None else 'set'}"
            )
        if a is not None and e is not None:
            assert_bitwise_equal(a, e, what=f"{context}: {name}")


def assert_restored_exactly(restored: torch.Tensor, original: torch.Tensor, what: str) -> None:
    """A restored saved tensor: same size, strides, dtype, device and bits as the original view."""
    assert_same_layout(restored, original, what)
    if restored.device != original.device:
        raise AssertionError(f"{what}: restored on {restored.device}, expected {original.device}")
    assert_bitwise_equal(restored, original, what)


def assert_nothing_held(manager: object, context: str) -> None:
    """After the graph is gone the manager holds no host data and no device tensors."""
    gc.collect()
    stats = manager.stats  # type: ignore[attr-defined]
    if stats.host_bytes_in_use != 0 or stats.device_bytes_held != 0:
        raise AssertionError(
            f"{context}: manager still holds host_bytes_in_use={stats.host_bytes_in_use}, "
            f"device_bytes_held={stats.device_bytes_held} after the graph was freed (stats: {stats})"
        )

"""Assertions of the swap I/O suite, with failure messages that say exactly what differed.

The central one is :func:`expected_direct`: the direct-versus-bounce rule restated from its definition (the
registry rule of the implementation's own ``ranges`` area, contiguity, and O_DIRECT alignment), independently of
the implementation's code, so the suite checks the decision instead of trusting it.
"""

from __future__ import annotations

import gc
import threading
from types import ModuleType

import torch

from conformance.areas.assertions import assert_bitwise_equal

O_DIRECT_ALIGNMENT = 4096


def expected_direct(t: torch.Tensor, ranges_api: ModuleType, o_direct: bool) -> tuple[bool, str]:
    """(decision, reason) for using ``t``'s own memory in a request whose file is (not) open with O_DIRECT."""
    if t.device.type != "cpu":
        return False, f"tensor on {t.device}"
    if not t.is_contiguous():
        return False, f"not contiguous (stride {t.stride()})"
    if t.numel() == 0:
        return False, "no elements"
    ptr, nbytes = ranges_api.tensor_extent(t)
    if not ranges_api.global_registry().contains(ptr, nbytes):
        return False, f"extent [{ptr:#x}, +{nbytes}) not inside one registered range"
    if o_direct and ptr % O_DIRECT_ALIGNMENT:
        return False, f"file open with O_DIRECT and address {ptr:#x} not {O_DIRECT_ALIGNMENT}-aligned"
    return True, f"extent [{ptr:#x}, +{nbytes}) registered" + (" and aligned" if o_direct else "")


def assert_decision(request: object, t: torch.Tensor, ranges_api: ModuleType, what: str = "request") -> bool:
    """The request's ``direct`` flag matches the rule for the tensor it moved; returns the decision."""
    o_direct = request.o_direct  # type: ignore[attr-defined]
    if o_direct not in (True, False):
        raise AssertionError(f"{what}: o_direct is {o_direct!r} after wait(); expected True or False")
    expected, reason = expected_direct(t, ranges_api, o_direct)
    got = request.direct  # type: ignore[attr-defined]
    if got is not expected:
        raise AssertionError(
            f"{what}: direct={got!r} but the rule says {expected} ({reason}); tensor shape={tuple(t.shape)} "
            f"stride={t.stride()} dtype={t.dtype} data_ptr={t.data_ptr():#x} o_direct={o_direct}"
        )
    return expected


def assert_round_trip(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality of the values read back with the values written (shape and dtype included)."""
    assert_bitwise_equal(actual.detach().cpu(), expected.detach().cpu(), what)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's contiguous image (what a record's payload must hold)."""
    src = t.detach().cpu()
    c = torch.empty(src.shape, dtype=src.dtype).copy_(src)  # standard strides even where size-1 dims are odd
    return bytes(c.reshape(-1).view(torch.uint8).numpy().tobytes()) if c.numel() else b""


def assert_bytes_equal(actual: bytes, expected: bytes, what: str) -> None:
    if actual == expected:
        return
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} bytes, expected {len(expected)}")
    first = next(i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b)
    raise AssertionError(
        f"{what}: bytes differ; first at byte {first}: {actual[first]:#04x} != expected {expected[first]:#04x} "
        f"(context {actual[max(0, first - 4):first + 4].hex()} vs {expected[max(0, first - 4):first + 4].hex()})"
    )


def assert_swap_error(exc: BaseException | None, cls: type, path: str | None, what: str) -> None:
    """``exc`` is an instance of ``cls`` (and of HostOffloadError), and its message names the path."""
    from reference.contract.errors import HostOffloadError

    if exc is None:
        raise AssertionError(f"{what}: no error raised, expected {cls.__name__}")
    if not isinstance(exc, cls):
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}; expected {cls.__name__}")
    if not isinstance(exc, HostOffloadError):
        raise AssertionError(f"{what}: {type(exc).__name__} is not a HostOffloadError")
    if path is not None and path not in str(exc):
        raise AssertionError(f"{what}: message {str(exc)!r} does not name the path {path!r}")


def thread_baseline() -> tuple[int, frozenset[threading.Thread]]:
    """``(threading.active_count(), the live threads)`` now, after a collection (for :func:`assert_no_new_threads`)."""
    gc.collect()
    return threading.active_count(), frozenset(threading.enumerate())


def assert_no_new_threads(baseline: tuple[int, frozenset[threading.Thread]], what: str) -> None:
    """No thread started since ``baseline`` is still alive, and ``threading.active_count()`` is not above it.

    Threads that other code ended meanwhile are fine (the count may drop); a thread the handle started is not.
    """
    count, before = baseline
    new = [t.name for t in threading.enumerate() if t not in before]
    now = threading.active_count()
    if new or now > count:
        raise AssertionError(f"{what}: threads started since the baseline still alive: {sorted(new)} "
                             f"(active_count {now}, {count} before)")


def assert_released(handle: object, pinning_api: ModuleType, threads_before: tuple[int, frozenset[threading.Thread]],
                    pinned_before: object, what: str) -> None:
    """After ``close()``: no worker thread alive, no bounce buffer out, pinned memory back where it started."""
    gc.collect()
    stats = handle.stats()  # type: ignore[attr-defined]
    if stats.threads != 0:
        raise AssertionError(f"{what}: {stats.threads} worker threads still alive after close()")
    if stats.bounce_in_use != 0 or stats.pool_bytes != 0:
        raise AssertionError(
            f"{what}: bounce pool not released after close(): {stats.bounce_in_use} buffers out, "
            f"{stats.pool_bytes} bytes held"
        )
    assert_no_new_threads(threads_before, what)
    pinned = pinning_api.pinned_stats()
    if pinned != pinned_before:
        raise AssertionError(f"{what}: pinned_stats {pinned} after close(), {pinned_before} before")


def assert_stats_consistent(stats: object, what: str) -> None:
    """Byte counters add up: direct + bounced == O_DIRECT + buffered == written + read."""
    moved = stats.bytes_written + stats.bytes_read  # type: ignore[attr-defined]
    split = stats.direct_bytes + stats.bounced_bytes  # type: ignore[attr-defined]
    path = stats.o_direct_bytes + stats.buffered_bytes  # type: ignore[attr-defined]
    if not moved == split == path:
        raise AssertionError(
            f"{what}: counters disagree: written+read={moved}, direct+bounced={split}, o_direct+buffered={path} "
            f"({stats})"
        )
    o_direct_bytes = stats.o_direct_bytes  # type: ignore[attr-defined]
    if not stats.o_direct_requested and o_direct_bytes:  # type: ignore[attr-defined]
        raise AssertionError(f"{what}: {o_direct_bytes} O_DIRECT bytes with use_o_direct=False")

"""The accelerator contract, for every discovered accelerator (available or not).

A vendor's accelerator is only as good as its truthfulness: these tests instantiate every entry point, check that
every abstract member is implemented, and exercise streams, events and host registration where the accelerator
says they exist.
"""

from __future__ import annotations

import inspect
import json
import mmap

import pytest
import torch

from reference.contract.accelerators import Accelerator, discover_accelerators, get_accelerator
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accelerator")

ALL = discover_accelerators()


@pytest.mark.parametrize("name", sorted(ALL), ids=[f"acc={n}" for n in sorted(ALL)])
def test_every_abstract_member_is_implemented(name):
    acc = ALL[name]
    cls = type(acc)
    assert isinstance(acc, Accelerator)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract members: {sorted(cls.__abstractmethods__)}"
    for member in sorted(Accelerator.__abstractmethods__):
        owner = next(k for k in cls.__mro__ if member in vars(k))
        assert owner is not Accelerator, f"{cls.__name__}.{member} is inherited from the abstract base"
    assert acc.name == name
    assert isinstance(acc.is_available(), bool)
    described = acc.describe()
    json.dumps(described)
    for flag in ("supports_streams", "has_torch_pinning", "supports_host_registration"):
        assert isinstance(described[flag], bool), f"{name}.{flag} must be a bool, got {described[flag]!r}"
    align = acc.host_register_alignment
    assert isinstance(align, int) and align > 0 and align & (align - 1) == 0, f"alignment {align} not a power of 2"


def test_cpu_is_always_available():
    assert "cpu" in ALL and ALL["cpu"].is_available()


def test_forcing_an_unknown_accelerator_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", "quantum-9000")
    with pytest.raises(ConfigurationError) as info:
        get_accelerator()
    message = str(info.value)
    assert "HOSTOFFLOAD_ACCELERATOR" in message and "quantum-9000" in message
    for known in ALL:
        assert known in message


def test_forcing_a_known_accelerator(accelerator, monkeypatch):
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", accelerator.name)
    assert get_accelerator() is accelerator


def test_streams_events_and_synchronize(accelerator):
    """Work queued on a side stream and fenced by an event is visible after the event (or at once, stream-less)."""
    dev = accelerator.device()
    assert dev.type == accelerator.device_type
    side = accelerator.new_stream()
    current = accelerator.current_stream()
    src = torch.arange(1 << 16, dtype=torch.float32, device=dev)
    with accelerator.stream(side):
        if accelerator.supports_streams:
            side.wait_stream(current)
        dst = src * 2
        event = accelerator.new_event()
        event.record(side)
    event.wait(current)
    event.synchronize()
    assert event.query() is True
    accelerator.synchronize()
    assert torch.equal(dst.cpu(), torch.arange(1 << 16, dtype=torch.float32) * 2)
    stats = accelerator.memory_stats()
    assert all(isinstance(v, int) for v in stats.values())


def test_peak_memory_counter(accelerator):
    """The peak counter ``gpu_memory_limit`` measures the floor with: None (and a reset that does nothing) where
    the device keeps none; where it does, an int that a reset restarts and that an allocation raises by at least
    its size, still after it is freed."""
    peak = accelerator.peak_memory_allocated()
    if peak is None:
        accelerator.reset_peak_memory()
        assert accelerator.peak_memory_allocated() is None, "a counter appeared after a reset"
        return
    assert type(peak) is int and peak >= 0, f"peak_memory_allocated() returned {peak!r}"
    accelerator.synchronize()
    accelerator.reset_peak_memory()
    base = accelerator.peak_memory_allocated()
    x = torch.empty(1 << 22, dtype=torch.uint8, device=accelerator.device())
    accelerator.synchronize()
    del x
    assert accelerator.peak_memory_allocated() >= base + (1 << 22), "a 4 MiB allocation did not raise the peak"


def test_host_registration_round_trip(accelerator):
    """register_host_memory on page-aligned memory returns True where supported, False (never raises) elsewhere."""
    size = 4 * mmap.PAGESIZE
    buf = mmap.mmap(-1, size)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    ptr = host.data_ptr()
    assert ptr % accelerator.host_register_alignment == 0
    ok = accelerator.register_host_memory(ptr, size)
    assert ok is accelerator.supports_host_registration
    if ok:
        try:
            if accelerator.device_type == "cuda":
                assert host.is_pinned(), "registered memory must be reported pinned by torch"
            host.copy_(torch.arange(size, dtype=torch.int64).to(torch.uint8))
            dev = host.to(accelerator.device(), non_blocking=True)
            back = torch.empty_like(host)
            back.copy_(dev, non_blocking=True)
            accelerator.synchronize()
            assert torch.equal(back, host)
        finally:
            accelerator.unregister_host_memory(ptr)
    del host
    buf.close()

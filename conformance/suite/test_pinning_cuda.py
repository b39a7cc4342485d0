"""CUDA-only pinning properties: registration is real, and DMA through registered buffers is exact.

On a CUDA accelerator the native backend registers its pages with the device. That registration is what lets
the copy engines read host memory directly, so it is checked from torch's side (``torch.Tensor.is_pinned()``
asks the CUDA runtime, not hostoffload), and asynchronous copies in and out of native buffers must give the
same bytes as a plain pageable round trip. Skipped (as a capability, not a stub) on accelerators that are not
CUDA.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.assertions import assert_bitwise_equal
from conformance.areas.strategies import dtypes, filled, nonempty_shapes

pytestmark = [pytest.mark.conformance_area("pinning"), pytest.mark.requires(pin_backends="native")]


@pytest.fixture
def cuda_native(impl, accelerator, monkeypatch):
    """The native backend with device registration on, on a CUDA accelerator."""
    if accelerator.device_type != "cuda":
        pytest.skip(f"CUDA-only property; accelerator {accelerator.name} is {accelerator.device_type}")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.delenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", raising=False)
    return accelerator


def _round_trip_async(accelerator, pinned_src: torch.Tensor, pinned_dst: torch.Tensor) -> None:
    """H2D then D2H with non_blocking=True on a side stream, synchronised only at the end."""
    device = accelerator.device()
    side = accelerator.new_stream()
    with accelerator.stream(side):
        on_device = pinned_src.to(device, non_blocking=True)
        on_device = on_device + 0  # a kernel between the copies, so the D2H really waits on the stream
        pinned_dst.copy_(on_device, non_blocking=True)
    side.synchronize()


def test_registered_native_buffer_is_pinned_for_torch(area_api, cuda_native):
    """torch.Tensor.is_pinned() is True for a registered native buffer and its views; False after unpin."""
    buf = area_api.pin_empty(3, 1 << 20, dtype=torch.uint8)
    assert buf.is_pinned(), "torch does not see the native buffer as pinned: it was not registered with CUDA"
    assert buf[1].is_pinned() and buf[2, 100:200].is_pinned()
    stats = area_api.pinned_stats()
    assert stats.registered_bytes >= 3 << 20, f"registered bytes not accounted: {stats}"
    assert area_api.unpin(buf) is True
    assert not buf.is_pinned(), "torch still sees the buffer as pinned after unpin (not unregistered)"
    del buf


def test_unregistered_buffer_is_locked_but_not_pinned_for_torch(area_api, cuda_native, monkeypatch):
    """REGISTER_DEVICE=off: hostoffload reports pinned (locked), torch does not (not registered)."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "off")
    buf = area_api.pin_empty(1 << 20, dtype=torch.uint8)
    assert area_api.is_pinned(buf)
    assert not buf.is_pinned()
    del buf


@pytest.mark.requires(calls=("pinning.pin_empty_like",))
@given(shape=nonempty_shapes, dtype=dtypes, seed=st.integers(0, 2**16), big=st.booleans())
def test_non_blocking_round_trip_is_exact(area_api, cuda_native, shape, dtype, seed, big):
    """Async H2D/D2H through native buffers gives exactly the bytes of a pageable round trip."""
    if big:
        shape = (*shape[:-1], shape[-1] * 4096)  # multi-page buffers: DMA crosses page boundaries
    src = filled(shape, dtype, seed)
    expected = src.to(cuda_native.device()).cpu()  # the pageable round trip
    pinned_src = area_api.pin_memory(src)
    pinned_dst = area_api.pin_empty_like(src)
    assert pinned_src.is_pinned() and pinned_dst.is_pinned()
    _round_trip_async(cuda_native, pinned_src, pinned_dst)
    assert_bitwise_equal(pinned_dst, expected, "non_blocking round trip through native pinned buffers")
    # Strided views of a registered buffer copy exactly too.
    view = pinned_src.view(-1)[1::2] if pinned_src.numel() > 1 else pinned_src.view(-1)
    assert_bitwise_equal(view.to(cuda_native.device(), non_blocking=True).cpu(), view, "strided view H2D")


@pytest.mark.requires("pinned_slab")
def test_slab_pieces_are_registered_and_copy_exactly(impl, area_api, cuda_native):
    """Pieces of a pinned slab (capability ``pinned_slab``) are pinned for torch and copy exactly."""
    module = impl.capabilities.pinned_slab
    slab_cls = importlib.import_module(module).PinnedSlab
    with slab_cls(8 << 20) as slab:
        a = slab.allocate(1000, 257, dtype=torch.float32)
        b = slab.allocate(1000, 257, dtype=torch.float32)
        assert a.is_pinned() and b.is_pinned() and area_api.is_pinned(a)
        a.copy_(filled((1000, 257), torch.float32, 3))
        _round_trip_async(cuda_native, a, b)
        assert_bitwise_equal(b, a, "slab piece round trip")
    assert not a.is_pinned(), "closing the slab must unregister it"


@pytest.mark.requires(calls=("pinning.pin_empty_like",))
def test_every_declared_tuning_variant_registers_and_copies_exactly(impl, area_api, cuda_native, monkeypatch):
    """Each environment in the capability ``pin_env_variants`` (tuning knobs of the implementation, e.g. the
    order of population and registration) still yields buffers torch sees as pinned, that copy exactly and that
    unpin unregisters. Implementations without tuning knobs run the check once, under the plain environment."""
    variants = impl.capabilities.env_variants() or ({},)
    src = filled((3, 1 << 18), torch.float32, 11)  # 3 MiB: several huge pages and a partial one
    expected = src.to(cuda_native.device()).cpu()
    for env in variants:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            pinned_src = area_api.pin_memory(src)
            pinned_dst = area_api.pin_empty_like(src)
            assert pinned_src.is_pinned() and pinned_dst.is_pinned(), f"not registered under {env}"
            _round_trip_async(cuda_native, pinned_src, pinned_dst)
            assert_bitwise_equal(pinned_dst, expected, f"non_blocking round trip under {env}")
            assert area_api.unpin(pinned_dst) is True and not pinned_dst.is_pinned(), f"unpin under {env}"
            del pinned_src, pinned_dst


@contextmanager
def _managed_cpu_tensor(nbytes: int) -> Iterator[torch.Tensor]:
    """A CPU tensor over CUDA managed memory (``cuMemAllocManaged``, in the current context). The CUDA runtime calls
    it managed, not host, memory, so torch's ``is_pinned`` is False for it. A query that takes any memory CUDA
    knows for pinned says otherwise, and so would one that ignores the managed flag on a driver that reports
    managed memory as host memory (the H200 box's driver reports it as device memory)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    address = ctypes.c_uint64(0)
    code = libcuda.cuMemAllocManaged(ctypes.byref(address), ctypes.c_size_t(nbytes), ctypes.c_uint(1))  # GLOBAL
    assert code == 0, f"cuMemAllocManaged failed with CUresult {code}"
    try:
        yield torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address.value), dtype=torch.uint8)
    finally:
        assert libcuda.cuMemFree_v2(address) == 0, "cuMemFree of the managed buffer failed"


def test_is_pinned_misses_agree_with_torch(area_api, cuda_native):
    """A registry miss is decided by what torch itself reports, however the implementation asks (the optimized
    one asks CUDA from C++): memory torch pinned, memory pinned behind hostoffload's back
    (``cudaHostRegister`` of a pageable buffer), pageable memory, a native buffer after ``unpin`` (locked no longer,
    unregistered), and device tensors. Each case is asked several times: the first miss may take another path
    than the ones after it (a cached decision), then once more from a thread that never called CUDA. Managed
    memory seen as a CPU tensor is not pinned for torch (the runtime's type is managed, not host)."""
    torch.cuda.init()
    torch.cuda.synchronize()  # the primary context is current on this thread (the managed allocation needs one)
    torch_pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(1 << 16, dtype=torch.uint8)
    foreign = torch.empty(1 << 16, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(foreign.data_ptr(), foreign.nbytes, 0)) == 0, "cudaHostRegister failed"
    with _managed_cpu_tensor(1 << 16) as managed:
        try:
            unpinned = area_api.pin_empty(1 << 16, dtype=torch.uint8)
            assert area_api.unpin(unpinned) is True
            cases = {
                "managed": (managed, False),
                "torch-pinned": (torch_pinned, True),
                "torch-pinned slice": (torch_pinned[100:200], True),
                "registered behind hostoffload's back": (foreign, True),
                "pageable": (pageable, False),
                "native after unpin": (unpinned, False),
                "device": (torch.empty(16, device=cuda_native.device()), False),
            }
            for _ in range(3):
                for what, (t, expected) in cases.items():
                    if t.is_cpu:
                        assert bool(t.is_pinned()) is expected, f"{what}: torch itself says {t.is_pinned()}"
                    assert area_api.is_pinned(t) is expected, f"{what}: is_pinned is not {expected}"
            # Again from a thread that has made no CUDA call: no context is current on it, which changes what some
            # CUDA queries answer (a driver-level query may refuse, or may answer for a context that is not current).
            answers: dict[str, object] = {}

            def ask_from_fresh_thread() -> None:
                for what, (t, _) in cases.items():
                    try:
                        answers[what] = area_api.is_pinned(t)
                    except Exception as exc:  # reported below with the case that raised it
                        answers[what] = exc

            worker = threading.Thread(target=ask_from_fresh_thread)
            worker.start()
            worker.join()
            for what, (_, expected) in cases.items():
                assert answers[what] is expected, f"{what}, from a fresh thread: is_pinned gave {answers[what]!r}"
        finally:
            assert int(cudart.cudaHostUnregister(foreign.data_ptr())) == 0


@pytest.mark.runs_in_subprocesses
def test_is_pinned_miss_in_a_forked_child_is_torchs_answer(impl, cuda_native):
    """In a child forked after CUDA was initialised (a data-loader worker, a launcher), a registry miss is still
    whatever torch answers there, value or exception: the child inherits what the implementation cached on its
    first misses and the entry points it resolved, but not a usable CUDA, so an implementation that asks the
    parent's driver from the child may answer for memory the child does not have pinned, or crash. Observed by
    conformance/probes/fork_cuda.py in a fresh interpreter (this process must not fork with CUDA initialised)."""
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.probes.fork_cuda", impl.areas["pinning"]],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"the probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {"torch-pinned": True, "registered behind hostoffload's back": True, "pageable": False}
    for what, asked in report["parent"].items():
        assert asked["torch"] == ["value", expected[what]], f"{what}, in the parent: torch itself says {asked['torch']}"
        assert asked["impl"] == asked["torch"], f"{what}, in the parent: is_pinned {asked['impl']}"
    child = report["child"]
    assert child["ok"], f"the forked child failed: {child.get('error')}"
    for round_name in ("cases", "again"):
        for what, asked in child[round_name].items():
            assert asked["impl"] == asked["torch"], (
                f"{what}, in the forked child ({round_name}): is_pinned {asked['impl']}, torch {asked['torch']}")

"""Offload semantics one behaviour at a time: layouts, never-offload rules, graph reuse, failures, nesting."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.assertions import assert_bitwise_equal
from conformance.areas.offload_assertions import assert_nothing_held

pytestmark = pytest.mark.conformance_area("offload")


def _manager(api, accelerator, **knobs):
    knobs.setdefault("min_offload_bytes", 0)
    knobs.setdefault("keep_last_count", 0)
    return api.ActivationOffload(accelerator=accelerator, **knobs)


@st.composite
def saved_views(draw):
    """(base shape, view recipe) covering offsets, slices with steps, transposes and stride 0."""
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["contiguous", "offset", "step", "transpose", "expand", "permute3d"]))
    return rows, cols, kind


def _make_view(base, kind):
    if kind == "offset":
        return base[1:] if base.shape[0] > 1 else base[:, 1:] if base.shape[1] > 1 else base
    if kind == "step":
        return base[::2, ::2]
    if kind == "transpose":
        return base.t()
    if kind == "expand":
        return base[:1].expand(base.shape[0] + 2, -1)
    if kind == "permute3d":
        return base.reshape(base.shape[0], base.shape[1], 1).expand(-1, -1, 2).permute(2, 0, 1)
    return base


@given(view=saved_views(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_restored_with_same_size_strides_and_bits(area_api, accelerator, view, dtype):
    rows, cols, kind = view
    device = accelerator.device()
    manager = _manager(area_api, accelerator)
    base = (torch.randn(rows + 1, cols + 1, dtype=torch.float64).to(dtype=dtype, device=device)).requires_grad_()
    engine = manager.engine
    with manager:
        src = _make_view(base * 1, kind)
        original = src.detach().clone()
        layout = (tuple(src.shape), src.stride())
        packed = engine.pack(src)
        del src
    restored = engine.unpack(packed)
    assert (tuple(restored.shape), restored.stride()) == layout, f"{kind}: layout {restored.stride()} != {layout}"
    assert restored.device == original.device, f"{kind}: restored on {restored.device}, not {original.device}"
    assert_bitwise_equal(restored, original, what=f"restored {kind} view")
    assert manager.stats.tensors_offloaded == 1, manager.stats


def test_never_offloaded_rules(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator)
    model = torch.nn.BatchNorm1d(4).to(device)
    weight = torch.nn.Parameter(torch.randn(4, 4, device=device))
    with manager:
        x = torch.randn(3, 4, device=device) * 1
        y = model(x)  # batch norm saves its weight/running stats: module state
        z = y @ weight.t()  # mm saves weight.t(): a view of a parameter
        meta = torch.empty(2, 2, device="meta", requires_grad=True) * 2
        _ = (meta * meta).sum()
        loss = z.sum()
    reasons = manager.stats.skipped_by_reason
    assert reasons.get("parameter_view", 0) >= 1, reasons
    assert reasons.get("meta", 0) >= 1, reasons
    assert reasons.get("parameter", 0) + reasons.get("module_state", 0) >= 1, reasons
    loss.backward()


def test_small_tensors_stay(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator, min_offload_bytes=1 << 20)
    with manager:
        x = torch.randn(8, 8, device=device, requires_grad=True)
        (x * 1).exp().sum().backward()
    assert manager.stats.tensors_offloaded == 0
    assert manager.stats.skipped_by_reason.get("small", 0) >= 1, manager.stats


def test_no_grad_forward_offloads_nothing(area_api, accelerator):
    manager = _manager(area_api, accelerator)
    with manager, torch.no_grad():
        x = torch.randn(16, 16, device=accelerator.device(), requires_grad=True)
        (x * 2).exp().sum()
    assert manager.stats.tensors_offloaded == 0 and manager.stats.tensors_skipped == 0, manager.stats


def _chain(x, n=4):
    for _ in range(n):
        x = torch.sin(x) * 1.5
    return x.sum()


def test_retain_graph_and_second_backward(area_api, accelerator):
    device = accelerator.device()
    x = torch.randn(32, device=device, requires_grad=True)
    _chain(x * 1).backward(retain_graph=False)
    expected = x.grad.clone()
    x.grad = None
    manager = _manager(area_api, accelerator, prefetch_count=2)
    with manager:
        loss = _chain(x * 1)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.equal(first, expected)
    assert torch.equal(x.grad, 2 * expected), "second backward must see the same restored values"
    assert manager.stats.tensors_restored == 2 * manager.stats.tensors_offloaded, manager.stats
    del loss
    assert_nothing_held(manager, "retain_graph")


def test_several_forwards_then_one_backward(area_api, accelerator):
    device = accelerator.device()
    xs = [torch.randn(64, device=device, requires_grad=True) for _ in range(3)]
    sum(_chain(x * 1) for x in xs).backward()
    expected = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    manager = _manager(area_api, accelerator, keep_last_count=1, prefetch_count=1)
    with manager:
        losses = [_chain(x * 1) for x in xs]
    sum(losses).backward()
    for i, (x, e) in enumerate(zip(xs, expected, strict=True)):
        assert torch.equal(x.grad, e), f"input {i} gradient differs"
    del losses
    assert_nothing_held(manager, "gradient accumulation")


@pytest.mark.requires(calls=("offload.current_manager",))
def test_exception_in_forward_cleans_up(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator)

    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom):
        with manager:
            x = torch.randn(128, device=device, requires_grad=True)
            y = _chain(x * 1)
            raise Boom(str(y))
    assert not manager.active
    assert area_api.current_manager() is None
    before = manager.stats.tensors_offloaded + manager.stats.tensors_skipped
    _chain(torch.randn(8, device=device, requires_grad=True) * 1)  # hooks must be gone: nothing packed
    assert manager.stats.tensors_offloaded + manager.stats.tensors_skipped == before, manager.stats
    del x, y
    assert_nothing_held(manager, "exception in forward")
    with manager:  # reusable afterwards
        _chain(torch.randn(8, device=device, requires_grad=True) * 1).backward()


@pytest.mark.parametrize("why_kept", ["pool_cap", "keep_window"])
@pytest.mark.parametrize("backward", [True, False], ids=["backward", "graph_dropped"])
def test_every_candidate_counted_once(area_api, accelerator, why_kept, backward):
    """Each candidate is counted exactly once, as offloaded or as kept (OffloadStats), whether a backward used it
    or autograd dropped the graph unused: kept for the pool cap, kept in the window, never both or twice."""
    device = accelerator.device()
    knobs = {"pool_bytes": 1} if why_kept == "pool_cap" else {"keep_last_count": 2}
    manager = _manager(area_api, accelerator, **knobs)
    n = 4  # _chain saves each sin's input: n candidates
    with manager:
        x = torch.randn(64, device=device, requires_grad=True)
        loss = _chain(x * 1, n)
    if backward:
        loss.backward()
    del loss
    gc.collect()
    s = manager.stats
    assert s.tensors_offloaded + s.tensors_kept == n, s
    expected_kept = n if why_kept == "pool_cap" else 2
    assert s.tensors_kept == expected_kept and s.bytes_kept == expected_kept * 64 * 4, s
    assert_nothing_held(manager, f"{why_kept}, backward={backward}")


def test_inplace_after_save_raises_like_autograd(area_api, accelerator):
    device = accelerator.device()

    def forward():
        x = torch.randn(16, device=device, requires_grad=True)
        a = x * 2
        b = a.sin()  # saves a
        a.mul_(3)  # modifies a saved tensor in place
        return b.sum()

    with pytest.raises(RuntimeError) as plain:
        forward().backward()
    for keep in (0, 1):  # offloaded and kept-on-device records
        manager = _manager(area_api, accelerator, keep_last_count=keep)
        with manager:
            loss = forward()
        with pytest.raises(RuntimeError) as offloaded:
            loss.backward()
        head = "one of the variables needed for gradient computation has been modified by an inplace operation"
        assert str(plain.value).startswith(head) and str(offloaded.value).startswith(head), (
            f"plain: {plain.value}\noffloaded: {offloaded.value}"
        )
        assert "is at version 1; expected version 0" in str(offloaded.value), str(offloaded.value)


@pytest.mark.requires(calls=("offload.current_manager",))
def test_nested_managers(area_api, accelerator):
    device = accelerator.device()
    x = torch.randn(64, device=device, requires_grad=True)
    (_chain(x * 1) + _chain(x * 2)).backward()
    expected = x.grad.clone()
    x.grad = None
    outer = _manager(area_api, accelerator)
    inner = _manager(area_api, accelerator)
    with outer:
        a = _chain(x * 1)
        with inner:
            assert area_api.current_manager() is inner
            b = _chain(x * 2)
        assert area_api.current_manager() is outer
    (a + b).backward()
    assert torch.equal(x.grad, expected)
    assert outer.stats.tensors_offloaded > 0 and inner.stats.tensors_offloaded > 0
    with pytest.raises(area_api.UnsupportedOperationError), outer, outer:
        pass


def test_keep_last_count_keeps_newest(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator, keep_last_count=2)
    with manager:
        x = torch.randn(32, device=device, requires_grad=True)
        loss = _chain(x * 1, n=5)
    stats = manager.stats
    assert stats.device_bytes_held > 0
    loss.backward()
    stats = manager.stats
    assert stats.tensors_kept == 2, stats
    assert stats.tensors_offloaded > 0


def test_restored_memory_released_during_backward(area_api, accelerator):
    """The manager must not keep restored tensors: during backward it holds at most the prefetch window."""
    device = accelerator.device()
    prefetch = 2
    manager = _manager(area_api, accelerator, prefetch_count=prefetch)
    n = 8
    nbytes = 256 * 4
    held = []
    with manager:
        h = torch.randn(256, device=device, requires_grad=True) * 1
        for _ in range(n):
            h = torch.sin(h)
            h.register_hook(lambda g: held.append(manager.stats.device_bytes_held) or g)
        loss = h.sum()
    loss.backward()
    assert held, "gradient hooks did not run"
    assert max(held) <= prefetch * nbytes, f"device bytes held during backward: {held} (limit {prefetch * nbytes})"
    del loss, h
    assert_nothing_held(manager, "early release")


def test_pool_cap_keeps_tensors_on_device(area_api, accelerator):
    device = accelerator.device()
    x = torch.randn(1024, device=device, requires_grad=True)
    _chain(x * 1).backward()
    expected = x.grad.clone()
    x.grad = None
    manager = _manager(area_api, accelerator, pool_bytes=1)
    with manager:
        loss = _chain(x * 1)
    assert manager.stats.host_bytes_in_use <= 1
    loss.backward()
    assert torch.equal(x.grad, expected)
    assert manager.stats.tensors_offloaded == 0 and manager.stats.tensors_kept > 0, manager.stats


def test_stats_are_consistent(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator)
    with manager:
        loss = _chain(torch.randn(512, device=device, requires_grad=True) * 1)
    loss.backward()
    s = manager.stats
    assert s.tensors_offloaded > 0 and s.bytes_offloaded == s.bytes_restored, s
    assert s.d2h_gbps is not None and s.d2h_gbps > 0 and s.h2d_gbps is not None and s.h2d_gbps > 0, s
    # The rates are bytes over the timed seconds, and printing the stats shows them (docs/offload.md promises
    # "GB/s each way" from print(manager.stats)).
    assert s.d2h_gbps == pytest.approx(s.d2h_timed_bytes / s.d2h_seconds / 1e9), s
    assert s.h2d_gbps == pytest.approx(s.h2d_timed_bytes / s.h2d_seconds / 1e9), s
    assert 0 < s.d2h_timed_bytes <= s.bytes_offloaded and 0 < s.h2d_timed_bytes <= s.bytes_restored, s
    shown = str(s)
    assert "d2h_gbps=" in shown and "h2d_gbps=" in shown and f"{s.d2h_gbps:.3f}" in shown, shown
    assert s.as_dict()["d2h_gbps"] == s.d2h_gbps and s.as_dict()["h2d_gbps"] == s.h2d_gbps
    assert s.compute_wait_seconds >= 0
    manager.reset_stats()
    assert manager.stats.tensors_offloaded == 0


def test_pool_reused_across_steps(area_api, accelerator):
    device = accelerator.device()
    manager = _manager(area_api, accelerator)
    allocations = []
    for _ in range(3):
        with manager:
            loss = _chain(torch.randn(4096, device=device, requires_grad=True) * 1)
        loss.backward()
        del loss
        gc.collect()
        allocations.append(manager.stats.host_allocations)
    if manager.stats.host_pool_bytes == 0:
        pytest.skip(f"{area_api.__name__} does not pool host memory (it allocates per tensor)")
    assert allocations[1] == allocations[2] == allocations[0], (
        f"pinned allocations per step grew after warm-up: {allocations}"
    )


def test_detached_module_weight_stays(area_api, accelerator):
    """docs/offload.md, never offloaded: a tensor whose storage belongs to a module that ran under the manager,
    even a ``detach()``-ed weight, which is neither a parameter nor a view of one in autograd's sense (so only the
    manager's record of module storages can keep it; ``test_never_offloaded_rules`` is satisfied by parameters)."""
    device = accelerator.device()
    manager = _manager(area_api, accelerator)

    class DetachedWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64, 64, device=device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.detach()  # mm saves the detached weight for x's gradient

    module = DetachedWeight()
    with manager:
        x = torch.randn(8, 64, device=device, requires_grad=True)
        y = module(x * 1)
    reasons = manager.stats.skipped_by_reason
    assert reasons.get("module_state", 0) >= 1, reasons
    assert manager.stats.tensors_offloaded == 0, manager.stats
    y.sum().backward()
    assert_bitwise_equal(x.grad, torch.ones(8, 64, device=device) @ module.weight.detach().t(), what="x.grad")

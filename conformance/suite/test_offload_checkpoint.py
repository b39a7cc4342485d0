"""Checkpointing on the offload engine, and ``mode="checkpoint_inputs"`` selection."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from conformance.areas.assertions import assert_names_argument

pytestmark = pytest.mark.conformance_area("offload")


def _block(w1, w2):
    def fn(x):
        return torch.tanh(x @ w1) @ w2 + torch.nn.functional.dropout(x, 0.3)

    return fn


def _setup(device, depth=3, width=16):
    g = torch.Generator().manual_seed(0)
    ws = [
        (
            torch.randn(width, width, generator=g).to(device).requires_grad_(),
            torch.randn(width, width, generator=g).to(device).requires_grad_(),
        )
        for _ in range(depth)
    ]
    leaf = torch.randn(4, width, generator=g).to(device).requires_grad_()
    return ws, leaf


def _run(ws, leaf, ckpt):
    for a, b in ws:
        a.grad = b.grad = None
    leaf.grad = None
    torch.manual_seed(5)
    h = leaf * 1
    for a, b in ws:
        h = ckpt(_block(a, b), h)
    (h**2).sum().backward()
    return [leaf.grad.clone()] + [p.grad.clone() for pair in ws for p in pair]


@pytest.mark.requires(calls=("offload.checkpoint",))
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_bitwise_equal_to_torch_checkpoint(area_api, accelerator, use_reentrant):
    device = accelerator.device()
    ws, leaf = _setup(device)
    expected = _run(ws, leaf, lambda f, h: torch_checkpoint.checkpoint(f, h, use_reentrant=use_reentrant))
    offload = area_api.ActivationOffload(accelerator=accelerator, min_offload_bytes=0, keep_last_count=0)
    actual = _run(ws, leaf, lambda f, h: area_api.checkpoint(f, h, use_reentrant=use_reentrant, offload=offload))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"gradient {i} differs (use_reentrant={use_reentrant})"
    stats = offload.stats
    # depth 3: the inputs of the 2nd and 3rd blocks are non-leaf activations; the 1st is leaf * 1 (also
    # non-leaf)
    assert stats.tensors_offloaded == 3 and stats.tensors_restored == 3, stats


@pytest.mark.requires(calls=("offload.checkpoint",))
def test_reentrant_checkpoint_leaves_inputs_untouched(area_api, accelerator):
    """The forward runs on the caller's inputs; they are neither emptied nor moved, before or after."""
    device = accelerator.device()
    ws, leaf = _setup(device, depth=1)
    offload = area_api.ActivationOffload(accelerator=accelerator, min_offload_bytes=0, keep_last_count=0)
    x = leaf * 1
    snapshot = x.detach().clone()
    seen = []

    def fn(inp):
        seen.append(inp.detach().clone())
        return _block(*ws[0])(inp)

    out = area_api.checkpoint(fn, x, use_reentrant=True, offload=offload)
    assert x.device == snapshot.device and x.shape == snapshot.shape and torch.equal(x, snapshot)
    assert torch.equal(seen[0], snapshot), "forward saw different input values"
    out.sum().backward()
    assert len(seen) == 2 and torch.equal(seen[1], snapshot), "recompute did not run on the restored input values"
    assert offload.stats.tensors_restored == 1


def test_checkpoint_inputs_mode_selects_only_checkpoint_inputs(area_api, accelerator):
    device = accelerator.device()
    ws, leaf = _setup(device)
    expected = _run(ws, leaf, lambda f, h: torch_checkpoint.checkpoint(f, h, use_reentrant=False))
    manager = area_api.ActivationOffload(
        accelerator=accelerator, mode="checkpoint_inputs", min_offload_bytes=0, keep_last_count=0
    )
    with manager:
        actual = _run(ws, leaf, lambda f, h: torch_checkpoint.checkpoint(f, h, use_reentrant=False))
        h = leaf * 1
        (torch.sin(h) ** 2).sum()  # saved activations outside any checkpoint: not candidates in this mode
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"gradient {i} differs"
    stats = manager.stats
    assert stats.tensors_offloaded == 3, stats
    assert stats.skipped_by_reason.get("not_checkpoint_input", 0) >= 2, stats


@pytest.mark.requires(calls=("offload.checkpoint", "offload.mark_checkpoint_input"))
def test_checkpoint_inputs_mode_with_own_checkpoint_and_marks(area_api, accelerator):
    device = accelerator.device()
    manager = area_api.ActivationOffload(
        accelerator=accelerator, mode="checkpoint_inputs", min_offload_bytes=0, keep_last_count=0
    )
    with manager:
        x = torch.randn(32, device=device, requires_grad=True) * 1
        area_api.mark_checkpoint_input(x)
        y = torch.sin(x)  # a marked tensor counts as a checkpoint input wherever it is saved
        z = area_api.checkpoint(torch.cos, y * 1, use_reentrant=True)
        loss = (z + y).sum()
    loss.backward()
    assert manager.stats.tensors_offloaded == 2, manager.stats


@pytest.mark.requires(calls=("offload.checkpoint",))
def test_checkpoint_argument_errors(area_api):
    with pytest.raises(area_api.ConfigurationError) as info:
        area_api.checkpoint(torch.sin, torch.ones(1), use_reentrant="yes")
    assert_names_argument(info.value, "use_reentrant")
    with pytest.raises(area_api.ConfigurationError) as info:
        area_api.checkpoint(torch.sin, torch.ones(1), offload=object())
    assert_names_argument(info.value, "offload")

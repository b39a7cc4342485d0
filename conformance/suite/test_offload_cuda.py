"""Stream-path properties that only a device with streams can show (skipped on accelerators without
streams).

- race: device-side delays injected on the compute stream (``torch.cuda._sleep``) between producing,
  offloading, and consuming activations must not change a bit of the gradients;
- memory: peak allocated memory with offload is at most the peak without offload minus the offloaded bytes,
  within one layer's worth of slack;
- host tensors are never offloaded.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.conformance_area("offload"), pytest.mark.gpu]


def _need_cuda(accelerator):
    if accelerator.device_type != "cuda" or not accelerator.supports_streams:
        pytest.skip(f"needs the cuda accelerator with streams, not {accelerator.name}")


class _Layer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x, sleep_cycles=0):
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _run(layers, leaf, checkpointed, sleep_cycles=0, manager=None, keep_grads=False):
    for p in [*layers.parameters(), leaf]:
        if keep_grads and p.grad is not None:
            p.grad.zero_()
        else:
            p.grad = None
    import contextlib

    with manager if manager is not None else contextlib.nullcontext():
        h = leaf * 1
        for layer in layers:
            if checkpointed:
                h = torch.utils.checkpoint.checkpoint(layer, h, sleep_cycles, use_reentrant=False)
            else:
                h = layer(h, sleep_cycles)
        loss = (h.float() ** 2).mean()
    if sleep_cycles:
        h.register_hook(lambda g: (torch.cuda._sleep(sleep_cycles), g)[1])
    loss.backward()
    return [leaf.grad.clone()] + [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_race_with_injected_delays(area_api, accelerator, checkpointed):
    _need_cuda(accelerator)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Layer(512) for _ in range(6)).cuda()
    leaf = torch.randn(64, 512, device="cuda", requires_grad=True)
    expected = _run(layers, leaf, checkpointed)
    manager = area_api.ActivationOffload(
        accelerator=accelerator, min_offload_bytes=0, keep_last_count=0, prefetch_count=3
    )
    for step in range(3):
        actual = _run(layers, leaf, checkpointed, sleep_cycles=2_000_000, manager=manager)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert torch.equal(a, e), f"step {step}: gradient {i} differs under injected delays"
    assert manager.stats.tensors_offloaded > 0


@pytest.mark.parametrize("prefetch_count", [0, 1])
def test_peak_memory_drops_by_offloaded_bytes(area_api, accelerator, prefetch_count):
    """Peak with offload <= peak without - offloaded bytes + one layer (the restored/prefetched input).

    Gradients stay allocated (zeroed between runs) so the peak of both runs is where activations dominate; a
    look-ahead of N tensors holds N inputs more at a block's peak, hence the property is stated for N <= 1.
    """
    _need_cuda(accelerator)
    torch.manual_seed(0)
    width, rows, depth = 1024, 4096, 8
    layers = torch.nn.ModuleList(_Layer(width) for _ in range(depth)).cuda()
    leaf = torch.randn(rows, width, device="cuda", requires_grad=True)
    layer_bytes = rows * width * 4

    def peak(manager):
        _run(layers, leaf, True, manager=manager, keep_grads=True)  # warm-up (allocator, pool, gradients)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _run(layers, leaf, True, manager=manager, keep_grads=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    without = peak(None)
    manager = area_api.ActivationOffload(
        accelerator=accelerator,
        mode="checkpoint_inputs",
        min_offload_bytes=0,
        keep_last_count=1,
        prefetch_count=prefetch_count,
    )
    with_offload = peak(manager)
    offloaded = manager.stats.bytes_offloaded // 2  # two runs counted
    assert offloaded >= (depth - 2) * layer_bytes, manager.stats
    # Slack: the property's one layer, plus 1 MiB for small tensors and allocator rounding that do not scale
    # with the layer (both implementations measured 0.14 MiB above one layer on an H200, torch 2.11).
    slack = layer_bytes + (1 << 20)
    assert with_offload <= without - offloaded + slack, (
        f"peak with offload {with_offload} > peak without {without} - offloaded {offloaded} + one layer "
        f"{layer_bytes} + 1 MiB (prefetch_count={prefetch_count})"
    )


def test_host_tensors_are_never_offloaded(area_api, accelerator):
    _need_cuda(accelerator)
    manager = area_api.ActivationOffload(accelerator=accelerator, min_offload_bytes=0, keep_last_count=0)
    with manager:
        x = torch.randn(64, requires_grad=True) * 1  # on the host
        loss = torch.sin(x).sum()
    loss.backward()
    assert manager.stats.tensors_offloaded == 0
    assert manager.stats.skipped_by_reason.get("host", 0) >= 1, manager.stats

"""R17 with an update that may still be running when ``step()`` returns (docs/zero.md, "Streamed offload").

An engine may return from a boundary ``step()`` while the offloaded optimizer is still updating later parts of
the model and copying them back (issue 16: the CPU Adam overlaps the next forward), provided every read sees the
updated weights: the next forward -- called on the module object the user built, right after ``step()``, with
nothing in between -- must compute exactly what it computes after a synchronous update. R17 says offload changes
placement only, so the losses of every micro-step and the final parameters of an offloaded run equal those of
the same run without offload, bitwise, on the host. The model is deep enough, the buckets small enough and the
CPU Adam held to one thread, so that an engine which let a forward read a bucket before its update landed, or
updated a bucket before the global norm was known (R15), would be caught.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from conformance.areas.accumulation_engines import REQUIRES_ENGINE, engine_api

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, pytest.mark.runs_in_subprocesses]

LAYERS, WIDTH, STEPS = 6, 160, 4


def _model() -> nn.Module:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


#: Engine calls that read weights, the master or the optimizer state, as CPU copies: each must see the whole update
#: of the step before it (docs/zero.md, "Streamed offload": every engine method that reads weights or optimizer
#: state waits for the update first). ``parameters`` / ``named_parameters`` are the module surface (docs/zero.md,
#: "The module surface"); the others are the engine protocol's.
_READS = {
    "parameters": lambda e: [p.detach().to("cpu", copy=True) for p in e.parameters()],
    "named_parameters": lambda e: [p.detach().to("cpu", copy=True) for _, p in e.named_parameters()],
    "state_dict": lambda e: [v.to("cpu", copy=True) for v in e.state_dict().values()],
    "full_parameters": lambda e: [v.to("cpu", copy=True) for v in e.full_parameters().values()],
    "master_partition": lambda e: [e.master_partition().to("cpu", copy=True)],
    "optimizer_state": lambda e: [torch.tensor(float(e.optimizer_state().step))]
    + [v.to("cpu", copy=True) for _, v in sorted(e.optimizer_state().buffers.items())],
}


def _train(group, engine_cls, stage: int, offload: bool, drain: bool = False, read: str | None = None) -> dict:
    """``drain``: read ``state_dict()`` after every step (a read that must see the whole update) before the next
    forward, so that forward cannot overtake an update still in flight. ``read``: right after every boundary
    ``step()``, before anything else, read through that :data:`_READS` call and keep what it returned."""
    # A slow update (one thread) widens the window in which a forward could overtake it.
    os.environ["HOSTOFFLOAD_CPU_ADAM_THREADS"] = "1"
    model = _model()
    config = {
        "zero_stage": stage, "gradient_accumulation_steps": 2, "dtype": "bf16", "grad_accum_dtype": "fp32",
        "gradient_clipping": 0.5, "optimizer": {"type": "adamw", "lr": 5e-2, "weight_decay": 0.01},
        "offload_optimizer": "cpu" if offload else "none",
        "offload_param": "cpu" if offload and stage == 3 else "none",
    }
    engine = engine_cls(model, config, process_group=group, bucket_elements=WIDTH * WIDTH)
    device = next(model.parameters()).device  # the engine placed the model (cuda with NCCL)
    gen = torch.Generator().manual_seed(7)
    losses, norms, reads = [], [], []
    try:
        for _ in range(2 * STEPS):
            x = torch.randn(16, WIDTH, generator=gen).to(device=device, dtype=torch.bfloat16)
            y = torch.randn(16, 4, generator=gen).to(device)
            loss = nn.functional.mse_loss(model(x).float(), y)  # the user's module, right after step()
            losses.append(loss.detach().to("cpu", copy=True))
            engine.backward(loss)
            out = engine.step()
            if out.boundary:
                norms.append(out.grad_norm)
                if read is not None:
                    reads.append(_READS[read](engine))
            if drain:
                engine.state_dict()
        params = {k: v.to("cpu", copy=True) for k, v in engine.state_dict().items()}
    finally:
        engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "reads": reads}


@pytest.mark.parametrize("stage", [2, 3])
def test_R15_R17_forward_right_after_step_sees_the_whole_update(impl, stage):
    """R17 + R15: with CPU offload, a forward issued immediately after each boundary ``step()`` gives the losses of
    the run without offload, bitwise, and so do the norms and the final parameters (the update may overlap the
    next forward, never change what it reads)."""
    api = engine_api(impl)
    plain = api.run_on_ranks(_train, 1, api.ZeroEngine, stage, False)[0]
    offloaded = api.run_on_ranks(_train, 1, api.ZeroEngine, stage, True)[0]
    assert offloaded["norms"] == plain["norms"], f"grad norms {offloaded['norms']} != {plain['norms']}"
    for i, (a, b) in enumerate(zip(offloaded["losses"], plain["losses"], strict=True)):
        assert torch.equal(a, b), f"micro-step {i}: loss {a.item()!r} with offload != {b.item()!r} without"
    for name, p in plain["params"].items():
        assert torch.equal(offloaded["params"][name], p), f"{name}: offloaded run != run without offload"


@pytest.mark.parametrize("read", sorted(_READS))
def test_R17_reads_right_after_step_see_the_whole_update(impl, read):
    """R17: with CPU offload at stage 2, each engine call that reads weights, the master or the optimizer state,
    made the moment a boundary ``step()`` returns, gives bitwise what it gives without offload -- the call waits
    for an update still in flight (one Adam thread and small buckets keep it in flight when the call comes), it
    never hands out a half-updated model."""
    api = engine_api(impl)
    plain = api.run_on_ranks(_train, 1, api.ZeroEngine, 2, False, False, read)[0]
    offloaded = api.run_on_ranks(_train, 1, api.ZeroEngine, 2, True, False, read)[0]
    assert len(offloaded["reads"]) == len(plain["reads"]) == STEPS
    for step, (got, want) in enumerate(zip(offloaded["reads"], plain["reads"], strict=True)):
        assert len(got) == len(want), f"{read}() after boundary {step}: {len(got)} tensors != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (
                f"{read}() right after boundary {step}'s step(): tensor {i} differs from the run without offload "
                f"(a read that did not wait for the update in flight)"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_R17_forward_right_after_step_on_nccl_equals_a_drained_run(impl, accelerator, stage):
    """R17 on the GPU (NCCL, world size 1): where the update streams weights back to the device while the next
    forward runs, a forward issued right after ``step()`` computes bitwise what it computes once
    ``state_dict()`` (a read that must see the whole update) was called in between -- same kernels, so any
    difference is a forward that read a parameter before its update landed."""
    api = engine_api(impl)
    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL); the host runs are the test above")
    eager = api.run_on_ranks(_train, 1, api.ZeroEngine, stage, True, False, backend="nccl")[0]
    drained = api.run_on_ranks(_train, 1, api.ZeroEngine, stage, True, True, backend="nccl")[0]
    assert eager["norms"] == drained["norms"], f"grad norms {eager['norms']} != {drained['norms']}"
    for i, (a, b) in enumerate(zip(eager["losses"], drained["losses"], strict=True)):
        assert torch.equal(a, b), f"micro-step {i}: loss {a.item()!r} right after step() != {b.item()!r} drained"
    for name, p in drained["params"].items():
        assert torch.equal(eager["params"][name], p), f"{name}: run without draining != drained run"

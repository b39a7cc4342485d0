"""hostoffload's one table of Adam kernels (issue 51 item 5), read by the engine, the conformance area and the
benchmarks.

Every kernel computes R16 bitwise like the torch-op sequence, so no trace can tell which one stepped a master: a
regression that silently falls back to torch ops (four times the memory traffic) passes every conformance test.
These check hostoffload's own wiring on the CPU: the area declares exactly the table's kernels, the engine's
choice for each kind of master is the table's, and what the engine calls is what was chosen.
"""

from __future__ import annotations

import pytest
import torch

from optimized.accumulation import adam_kernels
from optimized.accumulation.adam_kernels import ADAM_KERNELS, engine_kernel, kernel_named
from optimized.accumulation.optimizers import init_state, step_master
from optimized.optimizer_kernels import OPTIMIZER_KERNELS
from reference.contract.accumulation_config import OptimizerConfig

pytestmark = pytest.mark.conformance_area("harness")

ADAMW = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)


def test_the_area_declares_the_tables_kernels_in_its_order():
    assert [k.name for k in OPTIMIZER_KERNELS] == [k.name for k in ADAM_KERNELS if k.available()]


def test_the_engine_steps_a_host_master_with_the_native_kernel_and_sgd_with_torch_ops():
    if not kernel_named("native-cpu-adam").available():
        pytest.skip("this build has no native CPU Adam")
    master, grad = torch.randn(64), torch.randn(64)
    chosen = engine_kernel(ADAMW, master, grad, None)
    assert chosen is not None and chosen.name == "native-cpu-adam"
    assert engine_kernel(OptimizerConfig(type="sgd", lr=0.1), master, grad, None) is None
    assert engine_kernel(ADAMW, master.double(), grad.double(), None) is None, "fp64 is no fp32 master"
    strided = torch.randn(128)[::2]
    assert engine_kernel(ADAMW, strided, grad, None) is None, "the kernel needs a contiguous master"
    assert engine_kernel(ADAMW, master, strided, None) is None, "the kernel needs a contiguous gradient"


def test_step_master_runs_the_chosen_entry(monkeypatch):
    """``step_master`` calls the chosen entry's ``run`` (and only it), which advances the step and reports the
    bf16 copy written."""
    if not kernel_named("native-cpu-adam").available():
        pytest.skip("this build has no native CPU Adam")
    calls = []
    native = kernel_named("native-cpu-adam")

    def spy(*args):
        calls.append(args[0])
        return native.run(*args)

    patched = adam_kernels.KernelEntry(native.name, native.available, native.declaration, native.steps, spy)
    monkeypatch.setattr(adam_kernels, "ADAM_KERNELS", (patched, *ADAM_KERNELS[1:]))
    master, grad = torch.randn(64), torch.randn(64)
    state = init_state(ADAMW, master)
    out = torch.empty(64, dtype=torch.bfloat16)
    assert step_master(ADAMW, master, grad, state, clip_coef=None, bf16_out=out) is True
    assert calls == [ADAMW] and state.step == 1
    assert torch.equal(out, master.to(torch.bfloat16)), "the bf16 copy is not the updated master's"


def test_the_table_in_figures_and_frozen():
    """Both kernels are declared in this order (the fused one always: it names Triton in ``requires``, so a run
    without Triton reports its rules unjudged instead of dropping it); entries cannot be changed."""
    import dataclasses

    names = ["fused-device-adam"] if not kernel_named("native-cpu-adam").available() else [
        "native-cpu-adam", "fused-device-adam"]
    assert [k.name for k in OPTIMIZER_KERNELS] == names
    assert kernel_named("fused-device-adam").declaration().requires == ("triton",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ADAM_KERNELS[0].name = "other"  # type: ignore[misc]
    with pytest.raises(KeyError, match="native-cpu-adam"):
        kernel_named("no-such-kernel")


def test_the_fused_entry_steps_a_master_its_gradient_shares_a_device_with(monkeypatch):
    """Where the device kernel is chosen for the master's device (patched here: the CPU has no verdict for it), the
    engine uses it only for a contiguous gradient on the master's own device."""
    from optimized.accumulation import device_adam

    monkeypatch.setattr(device_adam, "use_for", lambda config, master, precision=None: True)
    fused = kernel_named("fused-device-adam")
    master = torch.randn(64)
    assert fused.steps(ADAMW, master, torch.randn(64), None) is True
    assert fused.steps(ADAMW, master, torch.randn(64, device="meta"), None) is False
    assert fused.steps(ADAMW, master, torch.randn(128)[::2], None) is False


def test_the_fused_entry_runs_the_engine_step():
    """The engine's call of the fused kernel (Triton's interpreter on the CPU): one step, the bf16 copy written
    where it is a contiguous buffer on the master's device (reported), left to the caller otherwise."""
    pytest.importorskip("triton")
    fused = kernel_named("fused-device-adam")
    master, grad = torch.randn(64), torch.randn(64)
    state = init_state(ADAMW, master)
    out = torch.empty(64, dtype=torch.bfloat16)
    assert fused.run(ADAMW, master, grad, state, None, out) is True and state.step == 1
    assert torch.equal(out, master.to(torch.bfloat16))
    strided = torch.empty(128, dtype=torch.bfloat16)[::2]
    assert fused.run(ADAMW, master, grad, state, 0.5, strided) is False and state.step == 2
    assert fused.run(ADAMW, master, grad, state, None, None) is False and state.step == 3

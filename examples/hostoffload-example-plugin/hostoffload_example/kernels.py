"""A third party's Adam, declared for judgement: torch.optim's Adam / AdamW driven on the caller's tensors.

The port ships no Adam of its own arithmetic; it wraps another library's (torch.optim), as a vendor wrapping a
CPU Adam from elsewhere would, and declares it in the ``optimizer_kernels`` area. torch.optim does not perform
R16's operation sequence (it moves the first moment with ``lerp``, divides the bias correction into the square
root and adds the update with ``addcdiv``), so the kernel declares a tolerance with that reason instead of the
reference's arithmetic, and the suite holds it to that tolerance.

Known gap, kept on purpose as the worked example of an expected-failure file: a gradient of the wrong size reaches
torch, which raises its own RuntimeError instead of the ConfigurationError R16's kernel inputs ask for. The
example's ``conformance-xfails.txt`` lists that one test, so a vendor's CI stays green while the report counts it
as an expected failure (docs/extending.md, "Running the suite in your CI").
"""

from __future__ import annotations

import torch

from reference.contract.errors import ConfigurationError
from reference.contract.optimizer_kernels import AdamKernel, Tolerance

__all__ = ["OPTIMIZER_KERNELS"]

_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def torch_optim_adam_step(config, param, grad, exp_avg, exp_avg_sq, step, *, grad_scale=None) -> None:
    """One torch.optim Adam / AdamW step on ``param`` in place, with ``exp_avg`` / ``exp_avg_sq`` as its state."""
    if config.type not in _CLASSES:
        raise ConfigurationError(f"config.type={config.type!r} is not a torch.optim Adam; allowed values: adam, adamw")
    if type(step) is not int or step < 1:
        raise ConfigurationError(f"step={step!r} must be an int >= 1 (the 1-based step count t)")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ConfigurationError(f"{name} is {t.dtype}; allowed: torch.float32")
        if not t.is_contiguous():
            raise ConfigurationError(f"{name} must be contiguous")
    weight = torch.nn.Parameter(param, requires_grad=True)  # shares param's storage: the step writes into it
    weight.grad = torch.mul(grad, grad_scale) if grad_scale is not None else grad.clone()
    optimizer = _CLASSES[config.type]([weight], lr=config.lr, betas=config.betas, eps=config.eps,
                                      weight_decay=config.weight_decay, foreach=False)
    optimizer.state[weight] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    with torch.no_grad():
        optimizer.step()


OPTIMIZER_KERNELS = (
    AdamKernel(
        name="torch-optim-adam",
        step=torch_optim_adam_step,
        arithmetic=Tolerance(rtol=1e-6, atol=1e-7, reason="torch.optim's operation order (lerp, addcdiv), not R16's"),
        devices=("cpu",),
    ),
)

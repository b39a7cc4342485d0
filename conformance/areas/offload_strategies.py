"""Hypothesis strategies for the offload suite: small layer stacks that stress what offload can get wrong.

A drawn :class:`StackSpec` describes a stack of blocks ``layer_norm -> linear -> gelu -> (view trick) ->
linear`` with optional residuals and dropout, each block optionally checkpointed (torch's non-reentrant
checkpoint as users write it, or the implementation's own checkpoint, reentrant or not). The view tricks
make autograd save exactly the awkward tensors: a view with a storage offset, a strided slice, a transposed
view and a stride-0 expanded tensor. The input may itself be a strided view, and may be shared with a side
branch (saved twice). :func:`run_step` runs one forward/backward and returns every gradient and the output,
detached, for bitwise comparison between a run with and a run without an offload manager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import strategies as st

VIEW_KINDS = ("none", "offset", "strided", "transpose", "expand")
CHECKPOINT_KINDS = ("none", "torch", "impl", "impl_reentrant")


@dataclass(frozen=True)
class StackSpec:
    dtype: torch.dtype
    batch: int
    widths: tuple[int, ...]  # len(widths) == depth + 1; all even
    residual: tuple[bool, ...]
    views: tuple[str, ...]
    checkpoints: tuple[str, ...]
    dropout: bool
    strided_input: bool
    shared_input: bool
    seed: int

    @property
    def depth(self) -> int:
        return len(self.widths) - 1


@st.composite
def stack_specs(draw: st.DrawFn, max_depth: int = 4, max_width: int = 24) -> StackSpec:
    depth = draw(st.integers(1, max_depth))
    widths = tuple(draw(st.lists(st.integers(1, max_width // 2), min_size=depth + 1, max_size=depth + 1)))
    widths = tuple(2 * w for w in widths)
    return StackSpec(
        dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
        batch=draw(st.integers(2, 6)),
        widths=widths,
        residual=tuple(draw(st.booleans()) for _ in range(depth)),
        views=tuple(draw(st.sampled_from(VIEW_KINDS)) for _ in range(depth)),
        checkpoints=tuple(draw(st.sampled_from(CHECKPOINT_KINDS)) for _ in range(depth)),
        dropout=draw(st.booleans()),
        strided_input=draw(st.booleans()),
        shared_input=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def offload_knobs(draw: st.DrawFn) -> dict[str, Any]:
    """Knob combinations that must never change results (only what moves, and when)."""
    return {
        "mode": draw(st.sampled_from(("all", "checkpoint_inputs"))),
        "min_offload_bytes": draw(st.sampled_from((0, 1, 64, 256))),
        "keep_last_count": draw(st.integers(0, 3)),
        "prefetch_count": draw(st.integers(0, 3)),
        "max_inflight_bytes": draw(st.sampled_from((None, 1, 512, 1 << 20))),
        "pool_bytes": draw(st.sampled_from((None, 1, 256 * 1024, 1 << 30))),
    }


class Block(torch.nn.Module):
    def __init__(self, w_in: int, w_out: int, residual: bool, view: str, dropout: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(w_in)
        self.fc1 = torch.nn.Linear(w_in, 2 * w_in)
        self.scale = torch.nn.Parameter(torch.ones(2 * w_in))
        self.fc2 = torch.nn.Linear(2 * w_in, w_out)
        self.residual = residual and w_in == w_out
        self.view = view
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.gelu(self.fc1(self.norm(x)))
        if self.view == "offset":  # mul saves z[1:], a view with a storage offset
            v = z[1:]
            z = torch.cat([z[:1], v * v], 0)
        elif self.view == "strided":  # mul saves a strided (non-contiguous) slice
            v = z[:, ::2]
            z = torch.cat([v * v, z[:, 1::2]], 1)
        elif self.view == "transpose":  # mul saves a transposed view
            z = (z.t() * self.scale[:, None]).t()
        elif self.view == "expand":  # mul saves a stride-0 expanded tensor
            s = z.mean(-1, keepdim=True).expand(-1, z.shape[-1])
            z = z * s
        if self.dropout:
            z = F.dropout(z, p=0.25, training=self.training)
        out = self.fc2(z)
        return out + x if self.residual else out


class Stack(torch.nn.Module):
    def __init__(self, spec: StackSpec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = torch.nn.ModuleList(
            Block(spec.widths[i], spec.widths[i + 1], spec.residual[i], spec.views[i], spec.dropout)
            for i in range(spec.depth)
        )
        self.side = torch.nn.Linear(spec.widths[0], spec.widths[-1]) if spec.shared_input else None

    def forward(self, x: torch.Tensor, api: Any) -> torch.Tensor:
        h = x
        for block, kind in zip(self.blocks, self.spec.checkpoints, strict=True):
            if kind == "torch":
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
            elif kind == "impl":
                h = api.checkpoint(block, h, use_reentrant=False)
            elif kind == "impl_reentrant":
                h = api.checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h)
        if self.side is not None:
            h = h + self.side(x)
        return h


def build_stack(spec: StackSpec, device: torch.device) -> Stack:
    torch.manual_seed(spec.seed)
    return Stack(spec).to(device=device, dtype=spec.dtype)


def make_input(spec: StackSpec, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.seed * 7919 + step)
    w = spec.widths[0]
    cols = 2 * w if spec.strided_input else w
    leaf = torch.randn(spec.batch, cols, generator=g).to(device=device, dtype=spec.dtype).requires_grad_()
    return leaf


def run_step(
    model: Stack, leaf: torch.Tensor, api: Any, step: int, manager: Any = None, backward_inside: bool = False
) -> dict[str, torch.Tensor | None]:
    """One forward (under ``manager`` if given) + backward; returns the output and every gradient."""
    model.zero_grad(set_to_none=True)
    leaf.grad = None
    torch.manual_seed(10_000 + step)  # dropout draws the same numbers with and without offload
    with manager if manager is not None else contextlib.nullcontext():
        x = leaf * 1  # a non-leaf input, so it is a candidate like a real hidden state
        if model.spec.strided_input:
            x = x[:, ::2]
        out = model(x, api)
        loss = (out.float() ** 2).mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    results: dict[str, torch.Tensor | None] = {
        "output": out.detach().clone(),
        "input.grad": leaf.grad.clone(),  # type: ignore[attr-defined]  # reset to None above, filled by backward()
    }
    for name, p in model.named_parameters():
        results[f"{name}.grad"] = None if p.grad is None else p.grad.detach().clone()
    return results

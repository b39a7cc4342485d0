"""ZeRO-3 + activation checkpointing with frozen parameters in the multi-process engine (R12, R21).

The runner-level R21 test uses torch's non-reentrant checkpoint inside the scenario model; this one drives the
engine directly with the project's activation-offload checkpoint (reentrant and non-reentrant) and torch's, on
two gloo ranks, and checks what the recompute saw, that nothing stays gathered, and that the result equals the
same run without checkpointing bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_ENGINE, engine_api, engine_class
from reference.accumulation import AccumulationConfig, AffineMap

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, IN_RANK_PROCESSES]


class _Recording(AffineMap):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x):
        self.seen.append(tuple(self.weight.shape))
        return super().forward(x)


class _Net(nn.Module):
    """inp (trainable) -> tanh -> [frozen -> tanh -> out], the bracket checkpointed with ``kind``."""

    def __init__(self, kind: str, offload_checkpoint=None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.kind = kind
        self.offload_checkpoint = offload_checkpoint  # the implementation's offload.checkpoint
        self.inp = _Recording(4, 6, gen)
        self.frozen = _Recording(6, 6, gen)
        self.frozen.requires_grad_(False)
        self.out = _Recording(6, 3, gen)

    def _tail(self, h):
        return self.out(torch.tanh(self.frozen(h)))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.kind == "none":
            return self._tail(h)
        if self.kind == "torch":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._tail, h, use_reentrant=False)
        return self.offload_checkpoint(self._tail, h, use_reentrant=self.kind == "offload-reentrant")


def _rank(group, impl, kind: str, dtype: str) -> dict:
    import torch.distributed as dist

    ZeroEngine = engine_class(impl)

    rank = dist.get_rank(group)
    cfg = AccumulationConfig(zero_stage=3, dtype=dtype, offload_param="cpu", offload_optimizer="cpu")
    offload = impl.load("offload").checkpoint if kind.startswith("offload") else None
    engine = ZeroEngine(_Net(kind, offload), cfg, process_group=group, record_gradients=True)
    gen = torch.Generator().manual_seed(100 + rank)
    leftovers, outcomes = [], []
    for _ in range(2):
        x = torch.randn(2, 4, generator=gen).to(cfg.model_dtype)
        engine.backward(engine(x).float().pow(2).mean().to(cfg.model_dtype))
        leftovers += [n for n, p in engine.module.named_parameters() if p.numel() != 0]
        out = engine.step()
        outcomes.append((out.grad_norm, out.gradients))
    result = {
        "frozen_seen": engine.module.frozen.seen,
        "out_seen": engine.module.out.seen,
        "leftovers": leftovers,
        "outcomes": outcomes,
        "params": engine.full_parameters(),
    }
    engine.destroy()
    return result


_PLAIN: dict[str, list] = {}
_REQUIRES_OFFLOAD = pytest.mark.requires(areas=("offload",))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "kind",
    ["torch", *(pytest.param(k, marks=_REQUIRES_OFFLOAD) for k in ("offload", "offload-reentrant"))],
)
def test_R21_R12_engine_recompute_sees_full_frozen_parameters(impl, area_api, kind, dtype):
    """R21: under ZeRO-3 (parameters and optimizer offloaded) every forward of the checkpointed region -- the
    original and the recompute in backward, with torch's non-reentrant checkpoint and the project's
    activation-offload checkpoint in both modes -- sees full-shape frozen and trainable parameters; R12: none is
    left gathered after backward(); norms, gradients and parameters equal the run without checkpointing."""
    api = engine_api(impl)
    checkpointed = api.run_on_ranks(_rank, 2, impl, kind, dtype)
    if dtype not in _PLAIN:  # the run without checkpointing is the same for every kind: run it once
        _PLAIN[dtype] = api.run_on_ranks(_rank, 2, impl, "none", dtype)
    plain = _PLAIN[dtype]
    for r in range(2):
        ck, pl = checkpointed[r], plain[r]
        assert ck["frozen_seen"] == [(6, 6)] * 4, f"rank {r}: the frozen layer saw {ck['frozen_seen']}"
        assert ck["out_seen"] == [(3, 6)] * 4, f"rank {r}: the out layer saw {ck['out_seen']}"
        assert pl["frozen_seen"] == [(6, 6)] * 2
        assert not ck["leftovers"], f"rank {r}: still gathered after backward(): {ck['leftovers']}"
        for (na, ga), (nb, gb) in zip(ck["outcomes"], pl["outcomes"], strict=True):
            assert na == nb, f"rank {r}: grad norm {na!r} != {nb!r} without checkpointing"
            for name in gb:
                assert torch.equal(ga[name], gb[name]), f"rank {r}: gradient {name} differs"
        for name, p in pl["params"].items():
            assert torch.equal(ck["params"][name], p), f"rank {r}: parameter {name} differs"


def _prefetch_rank(group, impl, prefetch: bool) -> dict:
    ZeroEngine = engine_class(impl)
    from reference.accumulation import ModelSpec, Scenario, compute_loss, micro_batch

    cfg = AccumulationConfig(zero_stage=3, dtype="bf16")
    sc = Scenario(cfg, 2, ())
    engine = ZeroEngine(ModelSpec(checkpoint=True).build(3), cfg, process_group=group, prefetch=prefetch)
    rank = engine.rank
    for k in range(3):
        engine.backward(compute_loss(engine.module, *micro_batch(sc, k, rank), cfg.model_dtype))
        engine.step()
    out = {"params": engine.full_parameters(), "hits": engine.prefetch_hits}
    engine.destroy()
    return out


def test_R12_stage3_prefetch_serves_gathers_and_changes_no_bit(impl, area_api):
    """R12: with prefetch on, stage-3 gathers after the first step are served by prefetched broadcasts (one
    module ahead in forward, one behind in backward) and the parameters after three steps equal those of a run
    without prefetch, bitwise, on both ranks."""
    api = engine_api(impl)
    on = api.run_on_ranks(_prefetch_rank, 2, impl, True)
    off = api.run_on_ranks(_prefetch_rank, 2, impl, False)
    for r in range(2):
        assert on[r]["hits"] > 0, f"rank {r}: prefetch never served a gather"
        assert off[r]["hits"] == 0
        for name, p in off[r]["params"].items():
            assert torch.equal(on[r]["params"][name], p), f"rank {r}: parameter {name} differs with prefetch"

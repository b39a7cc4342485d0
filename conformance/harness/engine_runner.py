"""The harness's multi-process scenario runner (R26) for any distributed engine:
``run_engine_scenario(engine_class, scenario) -> Trace``.

It is test machinery, not product: an implementation that declares ``distributed_engine`` provides a
``ZeroEngine`` class in its accumulation module and the suite drives that class here, so a third-party engine is
tested as itself and never with ours. Each of the scenario's W ranks is a process of a warm
:class:`~conformance.harness.rank_pool.WorkerPool` (gloo on the host by default, like the reference runner's host
default; NCCL, one GPU per rank, on request). Every rank builds the model from the scenario's spec and seed, wraps it in
the engine class (docs/extending.md lists the members used) and performs the calls exactly as
docs/accumulation.md's runner notes prescribe; the parent merges the per-rank records into the shared
:class:`~reference.accumulation.Trace` type after checking that all ranks agree on boundary flags and counters.

A call that raises on any rank surfaces here as the same exception class with the rank's message (the first
rank whose error is not a mere consequence -- a collective that failed because a peer stopped -- wins); a rank
stuck in a collective is killed after a grace period, so a failing run never hangs the caller.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

from conformance.harness.rank_pool import RankFailure, get_pool
from reference.contract import envvars
from reference.contract.accumulation_scenario import (
    ApplyDelayedUpdate,
    Backward,
    BackwardRecord,
    ControlRecord,
    Counters,
    EnterNoSync,
    Record,
    Scenario,
    SetBoundary,
    Step,
    StepRecord,
    Trace,
    compute_loss,
    micro_batch,
)
from reference.contract.envvars import normalize
from reference.contract.errors import ConfigurationError

__all__ = ["BACKEND_ENV", "POOL_SIZE_ENV", "TIMEOUT_ENV", "run_engine_scenario", "run_on_ranks"]

#: Default transport of run_scenario: gloo (host, the default), nccl (one GPU per rank) or auto.
BACKEND_ENV = envvars.ACCUMULATION_BACKEND_ENV
BACKENDS = ("gloo", "nccl", "auto")
#: Seconds a collective may wait before the process group reports a timeout (default 60).
TIMEOUT_ENV = envvars.ACCUMULATION_TIMEOUT_ENV
#: Ranks the host (gloo) pool starts with, so that growing W does not respawn it (default 4).
POOL_SIZE_ENV = envvars.ACCUMULATION_POOL_SIZE_ENV
#: Elements per stage-2/3 bucket in scenario runs: small, so several buckets and their overlap are exercised.
SCENARIO_BUCKET_ELEMENTS = 16


def _choose_backend(world: int, backend: str | None) -> str:
    """``backend`` argument, else ``$HOSTOFFLOAD_ACCUMULATION_BACKEND``, else ``gloo``.

    The host is the default for the same reason the reference runner defaults to ``device='cpu'``: the
    suite's exact properties (R5, R7-R11, R22-R24 ...) are statements about host arithmetic. ``nccl`` runs
    each rank on its own GPU; ``auto`` picks NCCL when the selected accelerator is cuda with at least W GPUs.
    Where NCCL is asked for but W GPUs are not there, the run falls back to gloo with a RuntimeWarning.
    """
    choice = backend if backend is not None else (normalize(os.environ.get(BACKEND_ENV)) or "gloo")
    if choice not in BACKENDS:
        name = "backend" if backend is not None else BACKEND_ENV
        raise ConfigurationError(f"{name}={choice!r} is not supported; allowed values: {', '.join(BACKENDS)}")
    if choice == "gloo":
        return "gloo"
    if choice == "auto":
        from reference.contract.accelerators import get_accelerator

        if get_accelerator().device_type != "cuda":
            return "gloo"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world:
        return "nccl"
    warnings.warn(
        f"run_scenario: world_size={world} needs {world} GPUs for NCCL, this host has {gpus}; "
        f"running the scenario on the host with gloo",
        RuntimeWarning,
        stacklevel=3,
    )
    return "gloo"


def _raise_failure(failures: list[RankFailure], world: int) -> None:
    primary = next((f for f in failures if not f.type_name.endswith("CollectiveError")), failures[0])
    others = ", ".join(f"rank {f.rank}: {f.type_name.rsplit('.', 1)[-1]}" for f in failures if f is not primary)
    note = f"raised on rank {primary.rank} of {world}" + (f" (also failed: {others})" if others else "")
    exc = primary.exception
    if exc is None:
        exc = RuntimeError(f"{primary.type_name}: {primary.message}")
    _add_note(exc, note)
    if primary.traceback:
        _add_note(exc, "rank traceback:\n" + primary.traceback)
    raise exc


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``: Python 3.11's; on 3.10 (which the package supports) the note goes where 3.11 keeps
    it, ``__notes__``, instead of failing with an AttributeError that hides the rank's error."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        vars(exc).setdefault("__notes__", []).append(note)


def run_on_ranks(fn: Any, world: int, *args: Any, backend: str | None = None, grace_s: float = 10.0) -> list[Any]:
    """Run the module-level function ``fn(group, *args)`` on ``world`` pool ranks; returns their results in
    rank order or raises the first rank's error (see module docstring). For engine tests and benchmarks."""
    if type(world) is not int or world < 1:
        raise ConfigurationError(f"world={world!r} must be an int >= 1")
    be = _choose_backend(world, backend)
    timeout = envvars.read_number(TIMEOUT_ENV, 1.0, 60.0)
    min_size = int(envvars.read_number(POOL_SIZE_ENV, 1.0, 4.0)) if be == "gloo" else world
    pool = get_pool(world, be, timeout_s=timeout, min_size=min_size)
    out = pool.run(fn, world, args, grace_s=grace_s)
    failures = [v for _, v in sorted(out.items()) if isinstance(v, RankFailure)]
    if failures:
        _raise_failure(failures, world)
    return [out[r] for r in range(world)]


def _counters(engine: Any) -> Counters:
    return Counters(engine.micro_steps, engine.global_steps, engine.global_samples)


def _host(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    if tensors is None:
        return None
    return {k: v.detach().to("cpu") for k, v in tensors.items()}


def _rank_run(group: Any, engine_class: type, scenario: Scenario, bucket_elements: int) -> dict[str, Any]:
    """One rank of a scenario (runs in a pool process); rank 0 also returns the tensors of the trace."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    model = scenario.model.build(scenario.seed)
    # A config that sets its own bucket size (DeepSpeed's reduce_bucket_size) is run with it: the engine refuses
    # an argument that disagrees with the config.
    engine = engine_class(
        model, scenario.config, process_group=group, device=device, record_gradients=True,
        bucket_elements=scenario.config.bucket_elements or bucket_elements,
    )
    dtype = scenario.config.model_dtype
    lead = rank == 0
    records: list[tuple] = []
    stack: list[Any] = []
    micro_index = 0
    try:
        initial = engine.full_parameters()
        for i, call in enumerate(scenario.calls):
            if isinstance(call, Backward):
                boundary = engine.is_gradient_accumulation_boundary()
                x, y = micro_batch(scenario, micro_index, scenario.data_rank(rank))
                loss = compute_loss(engine.module, x, y, dtype)
                engine.backward(
                    loss / call.loss_divisor if call.loss_divisor != 1 else loss, scale_wrt_gas=call.scale_wrt_gas
                )
                micro_index += 1
                records.append(("B", i, boundary, loss.detach().to("cpu").clone(), _counters(engine)))
            elif isinstance(call, Step):
                out = engine.step()
                params = engine.full_parameters()  # a collective at stage 3: every rank calls it
                records.append(
                    (
                        "S", i, out.boundary, _counters(engine),
                        out.grad_norm, out.clip_coef,
                        _host(out.gradients) if lead else None,
                        _host(params) if lead else None,
                    )
                )
            elif isinstance(call, SetBoundary):
                engine.set_gradient_accumulation_boundary(call.flag)
                records.append(("C", i, call, engine.is_gradient_accumulation_boundary()))
            elif isinstance(call, ApplyDelayedUpdate):
                engine.apply_delayed_update()  # a collective at stage 2 with W > 1: every rank calls it
                records.append(("C", i, call, engine.is_gradient_accumulation_boundary()))
            elif isinstance(call, EnterNoSync):
                ctx = engine.no_sync()
                ctx.__enter__()
                stack.append(ctx)
                records.append(("C", i, call, engine.is_gradient_accumulation_boundary()))
            else:
                if not stack:
                    raise ConfigurationError(f"calls[{i}] is ExitNoSync without a matching EnterNoSync")
                stack.pop().__exit__(None, None, None)
                records.append(("C", i, call, engine.is_gradient_accumulation_boundary()))
    finally:
        while stack:
            stack.pop().__exit__(None, None, None)
        engine.destroy()
    return {"initial": _host(initial) if lead else None, "records": records}


def _merge(scenario: Scenario, per_rank: list[dict[str, Any]]) -> Trace:
    lead = per_rank[0]["records"]
    for r, other in enumerate(per_rank[1:], start=1):
        for a, b in zip(lead, other["records"], strict=True):
            same = a[:3] == b[:3] and (a[0] != "B" or a[4] == b[4]) and (a[0] != "S" or a[3:6] == b[3:6])
            if not same:
                raise AssertionError(
                    f"ranks disagree at call {a[1]}: rank 0 recorded {a[:3]} {a[3:6] if a[0] == 'S' else ''}, "
                    f"rank {r} recorded {b[:3]} {b[3:6] if b[0] == 'S' else ''}"
                )
    records: list[Record] = []
    for k, rec in enumerate(lead):
        if rec[0] == "B":
            losses = tuple(p["records"][k][3] for p in per_rank)
            records.append(BackwardRecord(rec[1], rec[2], losses, rec[4]))
        elif rec[0] == "S":
            records.append(StepRecord(rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]))
        else:
            records.append(ControlRecord(rec[1], rec[2], rec[3]))
    return Trace(scenario, per_rank[0]["initial"], tuple(records))


def run_engine_scenario(
    engine_class: type, scenario: Scenario, *, backend: str | None = None,
    bucket_elements: int = SCENARIO_BUCKET_ELEMENTS,
) -> Trace:
    """Run ``scenario`` on W rank processes, one ``engine_class`` per rank, and return its trace (R26).

    ``engine_class`` must be importable by reference (it is pickled into the rank processes).
    ``backend``: ``gloo`` (host), ``nccl`` (one GPU per rank) or ``auto``; ``None`` reads
    ``$HOSTOFFLOAD_ACCUMULATION_BACKEND`` (default ``gloo``). See :func:`_choose_backend`.
    """
    if not isinstance(scenario, Scenario):
        raise ConfigurationError(f"scenario={scenario!r} must be a reference.accumulation.Scenario")
    if not isinstance(engine_class, type):
        raise ConfigurationError(f"engine_class={engine_class!r} must be a class (the implementation's ZeroEngine)")
    per_rank = run_on_ranks(
        _rank_run, scenario.world_size, engine_class, scenario, bucket_elements, backend=backend
    )
    return _merge(scenario, per_rank)

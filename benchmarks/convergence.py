"""Time to loss: a learnable synthetic language-modelling task with a known loss floor, and the loop that trains an
arm on it (``bench_zero_offload.py --mode converge``, issue 27 item 6).

A faster step is only faster training if the loss falls as fast per step: the delayed update (docs/accumulation.md
R27) takes 30 % off the offloaded step yet, without a warm-up, never leaves the unigram plateau of this task. So
the measure here is the wall time to reach a target loss, next to the median step time and the loss after N
boundaries.

The task, :class:`BigramChain`: ``ids`` of the model's token ids (drawn once from the seed), each with
``successors`` distinct successors among them (drawn once too). A sequence starts at a uniformly drawn id and
each next token is one of the current token's successors, uniformly. Every target token is then uniformly one of
``successors`` choices given the token before it and independent of anything earlier, so the expected
cross-entropy of the best possible predictor is exactly ``ln(successors)`` (the floor), while a model that has
learnt only token frequencies sits near ``ln(ids)`` (the unigram plateau). Batches are fresh at every step (no
sample repeats, so a falling loss is learning the rule, not memorising batches) and the same for every arm of one
seed and shape.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class BigramChain:
    """The sparse bigram chain (module docstring): ``vocab`` the model's vocabulary size, ``ids`` how many of its
    ids the chain uses, ``successors`` how many successors each has, ``seed`` everything random."""

    def __init__(self, vocab: int, ids: int, successors: int, seed: int) -> None:
        import torch

        for name, value, low in (("vocab", vocab, 2), ("chain ids", ids, 2), ("successors", successors, 1)):
            if type(value) is not int or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if ids > vocab:
            raise ValueError(f"chain ids={ids} must be <= the model's vocabulary size {vocab}")
        if successors > ids:
            raise ValueError(f"successors={successors} must be <= chain ids={ids}")
        self.vocab, self.ids, self.successors, self.seed = vocab, ids, successors, seed
        gen = torch.Generator().manual_seed(seed)
        #: state i of the chain is token ``tokens[i]``
        self.tokens = torch.randperm(vocab, generator=gen)[:ids]
        #: ``next_state[i, j]``: the j-th successor of state i (distinct per row, so each is 1/successors likely)
        self.next_state = torch.stack([torch.randperm(ids, generator=gen)[:successors] for _ in range(ids)])

    @property
    def loss_floor(self) -> float:
        """The expected cross-entropy (nats per token) of the best predictor: ``ln(successors)``."""
        return math.log(self.successors)

    @property
    def unigram_plateau(self) -> float:
        """About where a model that knows only which ids occur sits: ``ln(ids)`` (uniform over the chain's ids)."""
        return math.log(self.ids)

    def batches(self, steps: int, gas: int, batch: int, seq: int) -> torch.Tensor:
        """Token ids for a whole run, ``[steps, gas, batch, seq]``: step k, micro-batch m is ``out[k - 1, m]``.
        Drawn in one pass (one draw per position for all sequences at once) so that the data costs nothing inside
        the timed loop; deterministic in (seed, shape)."""
        import torch

        gen = torch.Generator().manual_seed(self.seed + 1)
        n = steps * gas * batch
        states = torch.empty(n, seq, dtype=torch.long)
        states[:, 0] = torch.randint(0, self.ids, (n,), generator=gen)
        choices = torch.randint(0, self.successors, (n, seq), generator=gen)
        for t in range(1, seq):
            states[:, t] = self.next_state[states[:, t - 1], choices[:, t]]
        return self.tokens[states].view(steps, gas, batch, seq)


@dataclass
class Trainer:
    """What the loop needs from an arm: one boundary (``step``: gas forward/backward + step on the given
    micro-batches, returning the mean micro-batch loss as a 0-d tensor), the learning rate setter, and optional
    hooks (``after_boundary(k)``: e.g. a warm-up's ``apply_delayed_update()``; ``timings()``: the engine's
    ``offload_timings``; ``finish()``: wait for an update in flight)."""

    step: Callable[[torch.Tensor], torch.Tensor]
    set_lr: Callable[[float], None]
    after_boundary: Callable[[int], None] = lambda k: None
    timings: Callable[[], dict | None] | None = None
    finish: Callable[[], None] = lambda: None
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Schedule:
    """The run: ``steps`` boundaries at ``lr`` after a linear warm-up over ``lr_warmup`` boundaries, stopped early
    once training has run ``arm_seconds`` (None: no limit); the target is met when the mean loss of the last
    ``smooth`` boundaries is <= ``target``."""

    steps: int
    lr: float
    lr_warmup: int
    target: float
    smooth: int
    arm_seconds: float | None

    def lr_at(self, k: int) -> float:
        """The learning rate of boundary k (1-based)."""
        return self.lr * min(1.0, k / self.lr_warmup) if self.lr_warmup > 0 else self.lr


def train(trainer: Trainer, data: torch.Tensor, schedule: Schedule, sync: Callable[[], None]) -> dict:
    """Train for ``schedule.steps`` boundaries on ``data`` (``BigramChain.batches`` on the arm's device).

    The clock: boundary 1 carries one-off start-up costs (kernel selection, the allocator's first blocks, lazy
    initialisation) that differ between implementations but not between update paths, so wall time is counted from
    its end: boundary 1's loss is plotted at 0 s and its duration is reported apart (``first_step_s``). Each
    boundary's loss is read (``float``) before its end time is taken, as a training loop that logs the loss does;
    that waits for the work queued on the current stream, not for an offloaded update running beside it, so the
    overlap the engine arranges is kept. ``sync`` waits for the device (end of the run only).
    """
    curve: list[tuple[int, float, float]] = []
    durations: list[float] = []
    t_first_end = None
    stopped = None
    for k in range(1, schedule.steps + 1):
        trainer.set_lr(schedule.lr_at(k))
        t0 = time.perf_counter()
        loss = float(trainer.step(data[k - 1]))
        trainer.after_boundary(k)
        t1 = time.perf_counter()
        if k == 1:
            t_first_end = t1
            first_step_s = t1 - t0
            if trainer.timings is not None:
                trainer.timings()  # drop boundary 1's share
        else:
            durations.append(t1 - t0)
        curve.append((k, t1 - t_first_end, loss))
        if not math.isfinite(loss):
            stopped = f"loss {loss} at boundary {k}"
            break
        if schedule.arm_seconds is not None and t1 - t_first_end > schedule.arm_seconds:
            stopped = f"arm time limit {schedule.arm_seconds:g} s after boundary {k}"
            break
    trainer.finish()
    sync()
    timings = trainer.timings() if trainer.timings is not None else None
    return summarize(curve, durations, first_step_s, schedule, timings, stopped)


def summarize(curve: list[tuple[int, float, float]], durations: list[float], first_step_s: float,
              schedule: Schedule, timings: dict | None, stopped: str | None) -> dict:
    """The arm's row: median step, loss after the run, time and boundaries to the target, the per-phase
    timeline (per boundary, boundaries 2..N) where the engine reports one."""
    smooth = schedule.smooth
    losses = [loss for _, _, loss in curve]
    reached = None
    for i in range(len(curve)):
        window = losses[max(0, i + 1 - smooth) : i + 1]
        if len(window) == smooth and sum(window) / smooth <= schedule.target:
            reached = curve[i]
            break
    row = {
        "boundaries": len(curve), "stopped": stopped, "first_step_s": first_step_s,
        "median_step_ms": statistics.median(durations) * 1e3 if durations else None,
        "mean_step_ms": statistics.fmean(durations) * 1e3 if durations else None,
        "final_loss": sum(losses[-smooth:]) / len(losses[-smooth:]),
        "target": schedule.target, "smooth": smooth,
        "steps_to_target": reached[0] if reached else None,
        "time_to_target_s": reached[1] if reached else None,
        "curve": [list(point) for point in curve],
    }
    if timings and durations:
        row["timeline_ms"] = timeline(timings, durations)
    return row


def timeline(timings: dict, durations: list[float]) -> dict[str, float]:
    """Per-boundary phases (ms) from an engine's ``offload_timings()`` summed over ``len(durations)`` boundaries:
    the training thread's step is ``exposed_wait`` (blocked on the offloaded update) plus ``compute`` (everything
    else it did: GPU forward/backward, launches, the reduction). Inside ``compute`` two offload costs are on the
    training stream's path: ``grad_exposed`` (the gradient stream still running after the boundary's backward,
    which the norm waits for) and ``device_adam`` (R28's device side); ``model`` is what is left. ``d2h``,
    ``grad_up`` (running sums back up for the next micro-batch's add), ``host_add`` (the middle micro-batches'
    running sums added on the host instead), ``host_adam`` and ``h2d`` ran beside it (side
    streams and the CPU Adam's threads), so they overlap the step and do not add up to it. ``gpu_idle`` is the
    part of the exposed wait during which the training stream had nothing to run (the thread launches ahead of the
    GPU, so queued work runs through the rest of the wait). ``host_adam_gbps``: the bytes the CPU Adam moved (its
    one-pass count, ``cpu_adam_bytes``) over its seconds -- the host update's bandwidth inside the engine, to set
    beside the kernel's own (``benchmarks/bench_host_update.py``). Keys an engine does not report count as 0."""
    n = len(durations)
    per = {k: timings.get(f"{k}_s", 0.0) / n * 1e3
           for k in ("d2h", "grad_up", "h2d", "grad_exposed", "device_adam", "gpu_idle", "host_add")}
    step = sum(durations) / n * 1e3
    wait = timings.get("wait_s", 0.0) / n * 1e3
    return {"step": step, "compute": step - wait, "exposed_wait": wait,
            "model": step - wait - per["grad_exposed"] - per["device_adam"],
            "host_adam": timings.get("cpu_adam_s", 0.0) / n * 1e3, **per,
            "host_adam_gbps": (timings.get("cpu_adam_bytes", 0.0) / timings["cpu_adam_s"] / 1e9
                               if timings.get("cpu_adam_s") else 0.0)}


#: The running mean the curve comparison takes (boundaries): on the GPU the loss of one boundary moves by several
#: per cent between two runs of the same arithmetic where it falls steeply (run AC), so single boundaries compare
#: the noise, not the arms.
COMPARE_WINDOW = 10


def compare_curves(curve: list, against: list, start: int, window: int = COMPARE_WINDOW) -> dict | None:
    """How far ``curve``'s loss is from ``against``'s, boundary by boundary from boundary ``start`` on: the
    relative difference of their ``window``-boundary running means, as ``mean_pct``, ``max_pct`` and the boundary
    ``max_at`` of the largest, over the boundaries both reached (``boundaries``). None: no boundary to compare.
    Curves are ``[boundary, wall_s, loss]`` points, as the rows keep them."""
    def means(points: list) -> dict[int, float]:
        losses = [p[2] for p in points]
        return {int(p[0]): statistics.fmean(losses[max(0, i + 1 - window) : i + 1]) for i, p in enumerate(points)}

    mine, theirs = means(curve), means(against)
    rel = {k: abs(mine[k] - theirs[k]) / abs(theirs[k]) for k in sorted(mine) if k >= start and k in theirs
           and theirs[k] != 0}
    if not rel:
        return None
    worst = max(rel, key=rel.get)
    return {"from": start, "window": window, "boundaries": len(rel),
            "mean_pct": 100 * sum(rel.values()) / len(rel), "max_pct": 100 * rel[worst], "max_at": worst}

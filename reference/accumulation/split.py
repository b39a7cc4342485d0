"""R28 in the reference: the optimizer step of a rank's partition cut between the device and the host.

The reference models arithmetic, not residency. Its masters stay where R17 puts them; the device side of the cut
is computed by copying that slice of master, gradient and optimizer state to the engine's device, taking one R16
step there and copying the result back, and the host side is the ordinary R16 step on the rest. Both sides take
the same step count ``t``, the same hyper-parameters and the same (already clipped) gradient. So on the cpu
accelerator the two sides run the same kernels and the split is bitwise the all-host update, which is the point
of the rule; on a device accelerator the device side is the device's arithmetic, within R25's tolerance.

``gpu_share: "auto"`` is decided at the second boundary, before its update (the first step carries one-off
start-up costs; until then everything is on the host): the measurement is the reference's own -- the R16 step
timed on a sample on each side, and as the work that can hide the host side, the time its backward calls of the
second step took per rank -- and the cut is :func:`reference.contract.accumulation_split.choose_split`'s.

With ``gpu_memory_limit`` the budget is what the engine's floor leaves
(:mod:`reference.contract.accumulation_limit`): the meter starts when the split is built (during the engine's
construction, once the masters exist) and the floor is read at the choice, before the timing sample is allocated;
the reference runs every rank in one process, so its floor is that process's device peak, all ranks together.
"""

from __future__ import annotations

import logging
import time

import torch

from reference.accumulation.optimizers import init_state, optimizer_step
from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_limit import fit_limit, floor_meter
from reference.contract.accumulation_split import (
    SplitDecision,
    SplitMeasurement,
    auto_budget,
    choose_split,
    fixed_split,
    sample_within,
    warn_if_auto_without_device,
)
from reference.contract.accumulation_step import OptimizerState

#: Elements the "auto" measurement steps on each side (or the whole partition when smaller).
SAMPLE_ELEMENTS = 1 << 14

_log = logging.getLogger("reference.accumulation")


class SplitUpdate:
    """One engine's R28 cut (the same for every rank: partitions have one size, R8) and the split R16 step."""

    def __init__(self, config: AccumulationConfig, partition_elements: int, device: torch.device,
                 host: torch.device, world_size: int) -> None:
        self._config = config
        self._P = partition_elements
        self._device, self._host = device, host
        self._world = world_size
        self._backward_s = 0.0
        self._boundaries = 0
        #: gpu_memory_limit: the engine's peak device memory from here to the choice (None without a limit)
        self._meter = floor_meter(config, device)
        warn_if_auto_without_device(config, device.type)
        #: None until "auto" has decided (at the second boundary)
        self.decision: SplitDecision | None = (
            # the one str gpu_share takes is GPU_SHARE_AUTO
            None if isinstance(config.gpu_share, str) else fixed_split(config.gpu_share, partition_elements, config)
        )

    def observe_backward(self, seconds: float) -> None:
        """The duration of one ``backward()`` (all ranks): what "auto" counts as work that hides the host side
        (the second step's only)."""
        if self._boundaries == 1:
            self._backward_s += seconds

    def boundary(self) -> None:
        """A boundary starts (once per boundary, before any rank's update): "auto" decides at the second."""
        self._boundaries += 1
        if self.decision is None and self._boundaries >= 2:
            self._decide()

    def _decide(self) -> None:
        """The "auto" choice from this engine's own measurement (module docstring); under ``gpu_memory_limit``
        the refusal where the floor leaves nothing (before anything of this boundary's update)."""
        cfg = self._config
        assert self._meter is None or cfg.gpu_memory_limit is not None  # metered under gpu_memory_limit only
        limit = (None if self._meter is None or cfg.gpu_memory_limit is None
                 else fit_limit(cfg.gpu_memory_limit, self._meter.floor()))
        n = max(1, sample_within(min(self._P, SAMPLE_ELEMENTS), None if limit is None else limit.budget_bytes, cfg))
        measurement = SplitMeasurement(
            host_s_per_element=self._time_step(n, self._host) / n,
            device_s_per_element=self._time_step(n, self._device) / n,
            hide_s=self._backward_s / self._world, sample_elements=n,
        )
        free = torch.cuda.mem_get_info(self._device)[0] if self._device.type == "cuda" else None
        budget = auto_budget(cfg, limit, free)
        self.decision = choose_split(self._P, cfg, budget, measurement, limit)
        _log.info("R28 gpu_share=auto chose %s", self.decision.as_dict())

    def _time_step(self, n: int, where: torch.device) -> float:
        master = torch.zeros(n, dtype=torch.float32, device=where)
        grad = torch.ones(n, dtype=torch.float32, device=where)
        state = init_state(self._config.optimizer, master, self._config.moment_precision)
        sync = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        optimizer_step(self._config.optimizer, master, grad, state)
        sync()
        return time.perf_counter() - t0

    def step(self, master: torch.Tensor, grad: torch.Tensor, state: OptimizerState,
             optimizer: OptimizerConfig | None = None) -> None:
        """R16 on ``master`` (one rank's partition) with its leading ``device_elements`` stepped on the device
        and the rest on the host, both with the step count ``state.step + 1``; advances ``state`` once.
        ``optimizer``: this boundary's hyper-parameters (a scheduled lr), default the config's."""
        optimizer = self._config.optimizer if optimizer is None else optimizer
        d = 0 if self.decision is None else self.decision.device_elements
        if d == 0:
            optimizer_step(optimizer, master, grad, state)
            return
        t = state.step
        for lo, hi, where in ((0, d, self._device), (d, self._P, self._host)):
            if lo == hi:
                continue
            side = OptimizerState(t, {k: v[lo:hi].to(where, copy=True) for k, v in state.buffers.items()})
            m = master[lo:hi].to(where, copy=True)
            optimizer_step(optimizer, m, grad[lo:hi].to(where, copy=True), side)
            master[lo:hi].copy_(m)
            for k, v in side.buffers.items():
                state.buffers[k][lo:hi].copy_(v)
        state.step = t + 1

"""A single-process model of W data-parallel ZeRO ranks with managed and unmanaged gradient accumulation.

Why simulate ranks instead of running a process group: the reference must be the obviously-correct oracle, and
with every rank in one process each collective is an explicit loop over tensors in a fixed order (R9, R10),
every buffer can be inspected, and a run needs neither a GPU nor a launcher. What is *not* simplified is the
order of operations that decides the last bits: where gradients are accumulated, in which dtype, when they are
reduced, how the norm is grouped, how the optimizer rounds. Those follow docs/accumulation.md rule by rule;
the rule ids are cited next to the code that implements them.

Each rank has its own replica of the model (``engine.module(rank)``). A training step is written as::

    losses = [loss_fn(engine.module(r), batch[r]) for r in range(engine.world_size)]
    engine.backward(losses)          # one loss per rank
    engine.step()
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from reference.accumulation.collectives import average_across_ranks
from reference.accumulation.optimizers import OptimizerState, init_state
from reference.accumulation.partition import FlatLayout, build_layout, flatten, gather, shard, unflatten
from reference.accumulation.split import SplitUpdate
from reference.accumulation.swap import OptimizerStateSwap
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_norm import clip_coefficient, fold_left, norm_from_total, rank_square_sum
from reference.contract.accumulation_schedule import AccumulationSchedule, ScheduledEngine
from reference.contract.accumulation_step import StepOutcome
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.lr_schedules import scheduled_optimizer
from reference.io import SwapStats

_HOST = torch.device("cpu")


def global_grad_norm(layout: FlatLayout, partitions: Sequence[torch.Tensor]) -> float:
    """R14: the L2 norm of the whole gradient from the per-rank partitions.

    Each rank sums the squares of each of its parameter pieces in fp64 and adds those per-piece sums in flat
    order; the per-rank sums are then added in rank order (the all-reduce of one fp64 scalar) and the square
    root is taken -- the contract's arithmetic (:mod:`reference.contract.accumulation_norm`), here over the
    simulated ranks.
    """
    return norm_from_total(fold_left(rank_square_sum(layout, r, part) for r, part in enumerate(partitions)))


class AccumulationEngine(ScheduledEngine):
    """W simulated data-parallel ranks of one model under a :class:`AccumulationConfig`.

    ``model`` is either a module (deep-copied once per rank, the caller's object is left untouched) or a
    zero-argument factory returning one. The engine casts it to ``config.dtype`` on ``device``.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        config: AccumulationConfig | Mapping[str, Any],
        world_size: int,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = AccumulationConfig.from_dict(config)
        if type(world_size) is not int or world_size < 1:
            raise ConfigurationError(f"world_size={world_size!r} must be an int >= 1")
        if self.config.pipeline_parallel_size != 1:
            raise UnsupportedOperationError(
                f"pipeline_parallel_size={self.config.pipeline_parallel_size} is not modeled by this engine "
                f"(data parallelism only); allowed: pipeline_parallel_size=1"
            )
        self.config.check_world_size(world_size)
        self.world_size = world_size
        self.device = torch.device(device)
        cfg = self.config
        self.stage = cfg.zero_stage
        base, named, trainable, frozen = self._build_model(model)
        self.parameter_names: tuple[str, ...] = tuple(n for n, _ in named)
        self.trainable_names: tuple[str, ...] = tuple(n for n, _ in trainable)
        self.frozen_names: tuple[str, ...] = tuple(n for n, _ in frozen)
        # R8: one layout for gradients, master weights and optimizer state; frozen parameters are partitioned
        # (stage 3 only) in a layout of their own because they have no gradient or optimizer state.
        self.layout = build_layout([(n, p.shape) for n, p in trainable], world_size)
        self.frozen_layout = build_layout([(n, p.shape) for n, p in frozen], world_size)

        # R17: offload moves where state lives, never what is computed (nvme: masters on the host like cpu).
        self.master_device = _HOST if cfg.masters_on_host else self.device
        self.param_device = _HOST if cfg.offload_param == "cpu" else self.device

        self.replicas: tuple[nn.Module, ...] = tuple(copy.deepcopy(base) for _ in range(world_size))
        self._params: list[dict[str, nn.Parameter]] = [dict(m.named_parameters()) for m in self.replicas]

        # R11/R12: fp32 master weights; stage 0 keeps the whole buffer on every rank, stages >= 1 one
        # partition.
        master_full = flatten(self.layout, dict(trainable), torch.float32, self.device)
        if self.stage == 0:
            masters = [master_full.clone().to(self.master_device) for _ in range(world_size)]
        else:
            masters = [shard(self.layout, master_full, r).clone().to(self.master_device) for r in range(world_size)]
        self._masters: list[torch.Tensor] = masters
        self._opt_states: list[OptimizerState] = [init_state(cfg.optimizer, m, cfg.moment_precision) for m in masters]
        # R28: each rank's partition cut between the device and the host (gpu_share 0: all on the host, R17).
        self._split = SplitUpdate(cfg, self.layout.partition_size, self.device, self.master_device, world_size)
        # R17 (nvme): between steps each rank's optimizer state lives in files, not in memory.
        self._swap: OptimizerStateSwap | None = None
        if cfg.offload_optimizer == "nvme":
            assert cfg.nvme_path is not None  # the config refuses nvme offload without an nvme_path
            self._swap = OptimizerStateSwap(cfg.nvme_path, cfg.nvme_swap)
            try:
                for r in range(world_size):
                    self._swap.swap_out(r, self._opt_states[r])
            except BaseException:
                self._swap.close()
                raise

        # Gradient accumulation state (R9 / R10).
        self._local_acc: list[torch.Tensor | None] = [None] * world_size
        self._shard_acc: list[torch.Tensor] = []
        if self.stage >= 2:
            self._shard_acc = [self._zero_partition() for _ in range(world_size)]

        # R12: stage 3 keeps only partitions of the parameters; replicas hold empty tensors between uses.
        self._hooks: list[Any] = []
        self._in_backward = False
        if self.stage == 3:
            self._partition_parameters(trainable, frozen)

        self._schedule = AccumulationSchedule(self.config, self.world_size, self.stage)
        self._destroyed = False

    def _build_model(self, model: nn.Module | Callable[[], nn.Module]) -> tuple[nn.Module, list, list, list]:
        """The module (copied, or made by the factory) in the model dtype on the device, and its named parameters:
        all, trainable, frozen."""
        base = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        if not isinstance(base, nn.Module):
            raise ConfigurationError(f"model={model!r} must be an nn.Module or a factory returning one")
        base = base.to(device=self.device, dtype=self.config.model_dtype)
        named = list(base.named_parameters())
        trainable = [(n, p) for n, p in named if p.requires_grad]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        if not trainable:
            raise ConfigurationError("model has no parameter with requires_grad=True; allowed: at least one")
        return base, named, trainable, frozen

    def _partition_parameters(self, trainable: list, frozen: list) -> None:
        """R12 (stage 3): each rank keeps its partition of the parameters, trainable and frozen in layouts of
        their own; the replicas hold empty tensors between uses, filled by the gather hooks."""
        dtype, device = self.config.model_dtype, self.device
        self._param_shards = [
            shard(self.layout, flatten(self.layout, dict(trainable), dtype, device), r).clone().to(self.param_device)
            for r in range(self.world_size)
        ]
        self._frozen_shards = [
            shard(self.frozen_layout, flatten(self.frozen_layout, dict(frozen), dtype, device), r)
            .clone()
            .to(self.param_device)
            for r in range(self.world_size)
        ]
        for rank in range(self.world_size):
            self._install_stage3_hooks(rank)
            self._release(rank, self.parameter_names)

    # ---- public surface ------------------------------------------------------------------------------------
    def module(self, rank: int) -> nn.Module:
        """Rank ``rank``'s replica: call it to run that rank's forward."""
        self._check_rank(rank)
        return self.replicas[rank]

    def _check_rank(self, rank: object) -> None:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ConfigurationError(f"rank={rank!r} must be an int in [0, {self.world_size - 1}]")

    def backward(self, losses: Sequence[torch.Tensor], scale_wrt_gas: bool = True) -> None:
        """Back-propagate one loss per rank and accumulate the gradients (R5, R7, R9, R10)."""
        self._check_alive()
        losses = list(losses)
        if len(losses) != self.world_size:
            raise ConfigurationError(
                f"losses has {len(losses)} entries; allowed: exactly world_size={self.world_size} (one per rank)"
            )
        if type(scale_wrt_gas) is not bool:
            raise ConfigurationError(f"scale_wrt_gas={scale_wrt_gas!r} must be a bool; allowed values: True, False")
        for r, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise ConfigurationError(f"losses[{r}] must be a one-element tensor that requires grad")
        grads: list[torch.Tensor] = []
        self._in_backward = True
        started = time.perf_counter()
        try:
            for loss in losses:
                # R5: the same division a user writes as ``loss / gas``, in the loss dtype.
                (loss / self.config.gradient_accumulation_steps if scale_wrt_gas else loss).backward()
            for r in range(self.world_size):
                grads.append(self._take_local_gradient(r))
        finally:
            self._in_backward = False
            for r in range(self.world_size):
                for p in self._params[r].values():
                    p.grad = None
                if self.stage == 3:
                    self._release(r, self.parameter_names)
        self._split.observe_backward(time.perf_counter() - started)
        self._accumulate(grads)
        self._schedule.backward_done()

    def step(self) -> StepOutcome:
        """R2-R4 / R6 and, at a boundary, the epilogue R13."""
        self._check_alive()
        with self._schedule.step() as boundary:
            outcome = self._boundary_epilogue() if boundary else StepOutcome(boundary=False)
        return outcome

    def full_parameters(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Copies of every parameter (model dtype, full shape) as rank ``rank`` would see it gathered."""
        self.module(rank)
        if self.stage == 3:
            out = dict(unflatten(self.layout, gather(self.layout, self._param_shards, self.device)))
            out.update(unflatten(self.frozen_layout, gather(self.frozen_layout, self._frozen_shards, self.device)))
            return {n: out[n].clone() for n in self.parameter_names}
        return {n: p.detach().clone() for n, p in self._params[rank].items()}

    def master_partition(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s fp32 master buffer (whole at stage 0, its partition from stage 1), a copy: what a
        distributed engine's ``master_partition()`` returns on that rank."""
        self._check_rank(rank)
        return self._masters[rank].clone()

    def master_partitions(self) -> list[torch.Tensor]:
        """:meth:`master_partition` of every rank, in rank order."""
        return [self.master_partition(r) for r in range(self.world_size)]

    def optimizer_state(self, rank: int) -> OptimizerState:
        """A copy of rank ``rank``'s optimizer state (read back from its swap files with ``nvme`` offload): what
        a distributed engine's ``optimizer_state()`` returns on that rank."""
        self._check_rank(rank)
        state = self._opt_states[rank]
        if self._swap is None:
            return OptimizerState(state.step, {k: v.clone() for k, v in state.buffers.items()})
        copy_ = OptimizerState(state.step, {})
        self._swap.swap_in(rank, copy_)
        return copy_

    def optimizer_states(self) -> list[OptimizerState]:
        """:meth:`optimizer_state` of every rank, in rank order."""
        return [self.optimizer_state(r) for r in range(self.world_size)]

    def split_report(self) -> dict | None:
        """R28: the cut of every rank's partition (``reference.contract.accumulation_split.SplitDecision`` as a
        mapping: the share, elements and device bytes, and for ``gpu_share: "auto"`` the measurement and budget
        it came from); None without a split (``gpu_share`` 0) and while "auto" has not decided yet (before the
        second boundary)."""
        decision = self._split.decision
        return None if decision is None or self.config.gpu_share == 0.0 else decision.as_dict()

    @property
    def swap_directory(self) -> str | None:
        """The directory this engine swaps optimizer state into (``nvme`` offload), else None."""
        return None if self._swap is None else self._swap.directory

    def swap_stats(self) -> SwapStats | None:
        """The swap handle's counters (``nvme`` offload), else None."""
        return None if self._swap is None else self._swap.handle.stats()

    def destroy(self) -> None:
        """Remove the stage-3 hooks, delete the swap files and drop every buffer; the engine cannot be used
        afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._swap is not None:
            self._swap.close()
        self._masters = []
        self._opt_states = []
        self._local_acc = []
        self._shard_acc = []
        self._destroyed = True

    # ---- gradients -----------------------------------------------------------------------------------------
    def _zero_partition(self) -> torch.Tensor:
        return torch.zeros(self.layout.partition_size, dtype=self.config.accum_dtype, device=self.device)

    def _take_local_gradient(self, rank: int) -> torch.Tensor:
        """R7: this backward's gradient of ``rank`` as a flat model-dtype buffer; no gradient means zeros."""
        params = self._params[rank]
        return flatten(
            self.layout,
            {n: params[n].grad for n in self.trainable_names},
            self.config.model_dtype,
            self.device,
        )

    def _accumulate(self, grads: list[torch.Tensor]) -> None:
        cfg = self.config
        if self.stage <= 1:
            # R9: accumulate locally in the accumulation dtype; nothing crosses ranks until the boundary.
            for r, g in enumerate(grads):
                accumulator = self._local_acc[r]
                if accumulator is None:
                    accumulator = torch.zeros(self.layout.total, dtype=cfg.accum_dtype, device=self.device)
                self._local_acc[r] = torch.add(accumulator, g.to(cfg.accum_dtype))
        else:
            # R10: reduce this backward's gradient (communication dtype), accumulate the owned partition.
            reduced = average_across_ranks([g.to(cfg.comm_dtype) for g in grads])
            for r in range(self.world_size):
                part = shard(self.layout, reduced, r).to(cfg.accum_dtype)
                self._shard_acc[r] = torch.add(self._shard_acc[r], part)

    def _boundary_epilogue(self) -> StepOutcome:
        """R13: finish reduction; norm; clip; optimizer; cast back and all-gather; clear gradient state."""
        cfg = self.config
        world = self.world_size
        layout = self.layout
        # 1. Finish the reduction: per rank, the gradient it owns, in the accumulation dtype.
        if self.stage <= 1:
            accs = [
                a if a is not None else torch.zeros(layout.total, dtype=cfg.accum_dtype, device=self.device)
                for a in self._local_acc
            ]
            reduced = average_across_ranks([a.to(cfg.comm_dtype) for a in accs]).to(cfg.accum_dtype)
            partitions = [shard(layout, reduced, r) for r in range(world)]
            owned = [reduced.clone() for _ in range(world)] if self.stage == 0 else [p.clone() for p in partitions]
        else:
            partitions = list(self._shard_acc)
            owned = [p.clone() for p in partitions]
        full_grad = gather(layout, partitions, self.device).to(torch.float32)
        gradients = {n: t.clone() for n, t in unflatten(layout, full_grad).items()}
        # 2. Global norm from the partitions (R14), for every stage.
        norm = global_grad_norm(layout, partitions)
        # 3. Clipping (R15), on the host when the optimizer is offloaded (R17).
        grads32 = [o.to(device=self.master_device, dtype=torch.float32) for o in owned]
        clip_coef = clip_coefficient(norm, cfg.gradient_clipping)
        if clip_coef is not None:
            grads32 = [torch.mul(g, clip_coef) for g in grads32]
        # R27: with the delayed update the parameters this boundary installs are the cast of the masters as they
        # are now (a copy: for an fp32 model the cast is the master itself), before this boundary's update, i.e.
        # what the previous boundary's update produced; this boundary's update reaches the parameters at the
        # next boundary (or at apply_delayed_update()). The first ``delayed_update_warmup`` boundaries (counted by
        # R3's global_steps, which still counts the boundaries before this one) are not delayed.
        delayed = cfg.delayed_parameter_update and self.global_steps >= cfg.delayed_update_warmup
        installed = [m.to(cfg.model_dtype, copy=True) for m in self._masters] if delayed else None
        # 4. Optimizer on the fp32 master of each rank (R16), its leading share on the device (R28), with this
        # boundary's hyper-parameters: the config's, or the scheduler section's value after global_steps earlier
        # boundaries (DeepSpeed steps its scheduler once per boundary, after the update).
        hyper = scheduled_optimizer(cfg.optimizer, cfg.scheduler, self.global_steps)
        self._split.boundary()
        for r in range(world):
            if self._swap is not None:
                self._swap.swap_in(r, self._opt_states[r])
            self._split.step(self._masters[r], grads32[r], self._opt_states[r], hyper)
            if self._swap is not None:
                self._swap.swap_out(r, self._opt_states[r])
        # 5. Cast back to the model dtype and all-gather (R12).
        if installed is None:
            installed = [m.to(cfg.model_dtype) for m in self._masters]
        self._install_parameters(installed)
        # 6. Clear the gradient state.
        self._local_acc = [None] * world
        if self.stage >= 2:
            self._shard_acc = [self._zero_partition() for _ in range(world)]
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=gradients)

    def _install_parameters(self, casts: list[torch.Tensor]) -> None:
        """R13 step 5: make ``casts`` (per rank, the model-dtype cast of its master buffer) every rank's
        parameters (stages 0-2: all-gathered into every replica; stage 3: the rank's partition)."""
        if self.stage == 0:
            for r in range(self.world_size):
                self._write_replica(r, casts[r].to(self.device))
        elif self.stage in (1, 2):
            full = gather(self.layout, casts, self.device)
            for r in range(self.world_size):
                self._write_replica(r, full)
        else:
            self._param_shards = [c.to(self.param_device) for c in casts]

    def apply_delayed_update(self) -> None:
        """R27: the update of the last boundary reaches the parameters now instead of at the next boundary (the
        parameters become the cast of the masters). A no-op without ``delayed_parameter_update``, where they
        already are."""
        self._check_alive()
        self._install_parameters([m.to(self.config.model_dtype) for m in self._masters])

    def _write_replica(self, rank: int, flat: torch.Tensor) -> None:
        views = unflatten(self.layout, flat)
        params = self._params[rank]
        with torch.no_grad():
            for n in self.trainable_names:
                params[n].copy_(views[n])

    # ---- stage 3 parameter lifecycle (R12, R21) ------------------------------------------------------------
    def _install_stage3_hooks(self, rank: int) -> None:
        names_of = {id(p): n for n, p in self._params[rank].items()}
        for mod in self.replicas[rank].modules():
            direct = tuple(names_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in names_of)
            if not direct:
                continue
            self._hooks.append(mod.register_forward_pre_hook(self._make_pre_forward(rank, direct)))
            self._hooks.append(mod.register_forward_hook(self._make_post_forward(rank, direct)))

    def _make_pre_forward(self, rank: int, names: tuple[str, ...]) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            # R21: every parameter of the module, frozen or not, is gathered before its forward runs,
            # including the forward that activation checkpointing replays during backward.
            self._gather(rank, names)

        return pre_forward

    def _make_post_forward(self, rank: int, names: tuple[str, ...]) -> Callable[..., None]:
        def regather(grad: torch.Tensor) -> None:
            self._gather(rank, names)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward:
                # A checkpoint recompute: keep the parameters until backward() ends, its nodes still need
                # them.
                return
            self._release(rank, names)
            # The module's backward reads the (released) parameters it saved; gather them again as soon as the
            # gradient reaches its output, i.e. before any of its backward nodes run.
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(regather)

        return post_forward

    def _gather(self, rank: int, names: Sequence[str]) -> None:
        params = self._params[rank]
        missing = [n for n in names if params[n].numel() == 0]
        if not missing:
            return
        views = {}
        if any(n in self.layout.names for n in missing):
            views.update(unflatten(self.layout, gather(self.layout, self._param_shards, self.device)))
        if any(n in self.frozen_layout.names for n in missing):
            views.update(unflatten(self.frozen_layout, gather(self.frozen_layout, self._frozen_shards, self.device)))
        for n in missing:
            params[n].data = views[n].clone()

    def _release(self, rank: int, names: Sequence[str]) -> None:
        params = self._params[rank]
        for n in names:
            p = params[n]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise UnsupportedOperationError("the engine was destroyed; allowed: build a new AccumulationEngine")


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a module's output (nested tuples, lists and mappings): where the stage-3 hooks attach."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from tensors_in(o)
    elif isinstance(output, Mapping):
        for o in output.values():
            yield from tensors_in(o)

"""The ZeRO data-parallel engine on torch.distributed (stages 0-3, managed and unmanaged accumulation, offload).

One instance per rank, like DeepSpeed's engine: each process wraps its model, calls ``backward(loss)`` and
``step()``, and the engine does the communication through a ``torch.distributed`` process group (gloo on CPU,
NCCL on GPUs; world size 1 works). The semantics are docs/accumulation.md's, rule for rule, and the arithmetic is
the reference's: on the host the trace of a scenario equals the reference trace bitwise at every world size
(reductions are rank-ordered, see :mod:`optimized.accumulation.collectives`; the optimizer is the R16 formula,
natively, see :mod:`optimized.cpu_adam`).

This class is the training surface and the schedule; what happens where is in modules of its own:

- :mod:`.construction` -- what is checked before any buffer exists (arguments, device, the same model on every
  rank) and the model's parameters as the engine keeps them; :mod:`.ownership` -- one live engine per model;
- :mod:`.parts` -- everything an engine owns (hooks, pinned buffers, weights, update path, stage 3), built in
  order by ``build_parts`` and released by ``EngineParts.close`` (``destroy()``, or a failed construction);
- :mod:`.weights` -- the model-dtype parameters (R1, R12): views of one flat buffer at stages 0-2, this rank's
  partitions at stage 3 (pinned on the host with ``offload_param``);
- :mod:`.gradients` -- the gradient hooks and the per-bucket reduce-scatters of stages 2/3 (R7, R9, R10);
- :mod:`.update_paths` -- the update path ``offload_optimizer`` selects, chosen once at construction: it owns the
  master, the optimizer state and the gradient accumulator, and runs the boundary (R13-R17): on the device, on
  the host (streamed per bucket at stages 2/3 with the native Adam, overlapping backward and the next forward;
  with the opt-in ``delayed_parameter_update``, R27, the whole next step), or on the host with the state in
  ``nvme`` files between steps;
- :mod:`.stage3` -- stage 3's gather / release / prefetch hooks (R12, R21);
- :mod:`.checkpoint` -- ``save_checkpoint`` / ``load_checkpoint`` (per-rank files in parameter coordinates, staged
  and committed by one rename, loadable at any world size, stage and update path) and the consolidated
  ``state_dict`` / ``load_state_dict``, reading the engine through a :class:`~.checkpoint_view.CheckpointView`;
- :mod:`.lr` -- ``engine.optimizer`` and ``LrSchedule`` (the attached ``lr_scheduler``, ``get_lr`` / ``set_lr``);
- :mod:`.engine_surface` -- the surface that only passes through, as base classes: the module's (``engine(x)``,
  ``train``/``eval``, ``parameters``), the learning rate's and the reports (``offload_timings()``,
  ``split_report()``, ``overlap_report()``, ``pinned_buffers()`` ...).

What a training script uses besides backward()/step() (docs/zero.md): ``engine.optimizer``, a
``torch.optim.Optimizer`` facade whose group values the boundary update reads (:mod:`.lr`), so any
``torch.optim.lr_scheduler`` drives it (``engine.lr_scheduler`` is stepped at boundaries); ``save_checkpoint`` /
``load_checkpoint``; the consolidated ``state_dict()`` / ``load_state_dict()``; ``zero_grad``, ``train``/``eval``,
``parameters``. Misuse is refused at the call, before anything changes: a loss whose graph reaches neither this
model's outputs nor its trainable parameters, a model (or sub-module) another live engine wraps, an
``nvme_path`` where no file can be created.

Failure: a rank that raises stops calling collectives; the others fail in their next collective after the
process group's timeout with :class:`~optimized.accumulation.collectives.CollectiveError` (never a silent hang
longer than that timeout). After any error call :meth:`ZeroEngine.destroy` (it never communicates) and build a
new engine.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optimized.accumulation import checkpoint as ckpt
from optimized.accumulation import device_adam
from optimized.accumulation.checkpoint_view import CheckpointView
from optimized.accumulation.collectives import Collectives
from optimized.accumulation.construction import (
    bucket_size,
    build_module,
    check_engine_arguments,
    model_parameters,
    resolve_device,
)
from optimized.accumulation.engine_surface import EngineReports, LrSurface, ModuleSurface
from optimized.accumulation.host_memory import estimate_host_memory
from optimized.accumulation.lr import EngineOptimizer, LrSchedule, config_scheduler
from optimized.accumulation.origin import LossOrigin
from optimized.accumulation.ownership import check_not_owned
from optimized.accumulation.parts import LiveParts, build_parts
from optimized.accumulation.update_paths import update_path_class
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_schedule import AccumulationSchedule, ScheduledEngine
from reference.contract.accumulation_step import OptimizerState, StepOutcome
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "GradientPhase", "StepOutcome", "ZeroEngine"]


class GradientPhase(enum.Enum):
    """Where a ZeroEngine's gradients stand between two boundaries: one state, where two flags (in backward,
    gradients pending) could disagree."""

    #: nothing accumulated since the last boundary, ``zero_grad()`` or checkpoint load
    CLEAN = "clean"
    #: ``backward()`` is running: the hooks accumulate into the engine's buffers
    IN_BACKWARD = "in backward"
    #: gradients accumulated that no boundary has consumed yet
    ACCUMULATED = "accumulated"


#: Elements per gradient bucket at stages 2/3 (25M; DeepSpeed 0.19's reduce_bucket_size defaults to 5e8: docs/zero.md).
DEFAULT_BUCKET_ELEMENTS = 25_000_000


class ZeroEngine(ModuleSurface, LrSurface, EngineReports, ScheduledEngine):
    """One rank of a ZeRO data-parallel run of ``model`` under ``config`` (docs/accumulation.md, docs/zero.md).

    ``model``: an ``nn.Module`` (used in place, cast to the model dtype and moved to ``device``) or a factory.
    ``process_group``: default the world group. ``device``: default ``cuda:<current>`` with NCCL, else cpu.
    ``record_gradients``: return the full reduced gradient from boundary steps (an extra all-gather; the
    conformance runner uses it). ``bucket_elements``: stage-2/3 bucket size (None: the config's ``bucket_elements``,
    DeepSpeed's ``reduce_bucket_size``, else 25M; both given must agree). ``prefetch``: stage-3 prefetch
    of the next module's parameters (one module ahead in forward, one behind in backward).

    Attributes besides the config and the rank's identity: ``module`` (the wrapped model: call it, or the engine,
    for the forward), ``master_device`` (where this rank's fp32 master lives: the host with optimizer offload,
    R17), ``param_device`` (where stage-3 parameter partitions live: the host with ``offload_param``).
    """
    estimate_host_memory = staticmethod(estimate_host_memory)

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        config: AccumulationConfig | Mapping[str, Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        record_gradients: bool = False,
        bucket_elements: int | None = None,
        prefetch: bool = True,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if initialized else None
        # DeepSpeed's nested shape is accepted too; train_batch_size is checked against (or completes the batch
        # keys from) this group's world size.
        self.config = cfg = AccumulationConfig.from_dict(config, world_size=world)
        bucket_elements = check_engine_arguments(
            cfg, initialized, bucket_size(bucket_elements, cfg, DEFAULT_BUCKET_ELEMENTS), record_gradients, prefetch
        )
        self._comm = Collectives(process_group)
        self.world_size, self.rank, self.stage = self._comm.world, self._comm.rank, cfg.zero_stage
        self.device = resolve_device(device, process_group)
        device_adam.check_engine_device(self.device)  # HOSTOFFLOAD_DEVICE_ADAM=fused where the kernel never runs
        self.record_gradients, self.prefetch = record_gradients, prefetch
        module = build_module(model)
        check_not_owned(module)
        #: The one place the offload configuration is decoded (update_paths/); build_parts builds the path.
        path_class = update_path_class(cfg)
        path_class.check_config(cfg)
        self.module = module.to(device=self.device, dtype=cfg.model_dtype)
        params = model_parameters(self._comm, self.module)
        self.parameter_names = tuple(params.params)
        self.trainable_names, self.frozen_names = params.trainable_names, params.frozen_names
        self.layout, self.frozen_layout, self._model = params.layout, params.frozen_layout, params
        self._schedule = AccumulationSchedule(self.config, self.world_size, self.stage)
        #: Where the gradients stand between boundaries (save_checkpoint refuses to drop accumulated ones; calls
        #: that would change the state backward reads are refused while it runs).
        self._phase = GradientPhase.CLEAN
        #: What makes a loss this engine's (R20: a foreign loss is rejected before anything is accumulated).
        self._origin = LossOrigin(params.trainable)
        #: The torch.optim.Optimizer facade LR schedules are built on (docs/zero.md, "LR schedules").
        self.optimizer = EngineOptimizer(params.trainable, cfg.optimizer)
        self._lr = LrSchedule(self.optimizer)
        if cfg.scheduler is not None:  # DeepSpeed builds its configured scheduler at construction too
            self._lr.attach(config_scheduler(self.optimizer, cfg))
        #: Everything destroy() releases, built (and on a failure released) by build_parts.
        self._parts = parts = build_parts(
            config=cfg, path_class=path_class, module=self.module, params=params, comm=self._comm,
            device=self.device, bucket_elements=bucket_elements, prefetch=prefetch, schedule=self._schedule,
            origin=self._origin, in_backward=self._in_backward, hyper_now=self.optimizer.current,
        )
        live = parts.live()
        self.master_device, self.param_device = live.path.master.device, live.weights.param_device

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Back-propagate this rank's ``loss`` and accumulate (R5, R7, R9, R10)."""
        parts = self._check_alive()
        if type(scale_wrt_gas) is not bool:
            raise ConfigurationError(f"scale_wrt_gas={scale_wrt_gas!r} must be a bool; allowed values: True, False")
        self._origin.check_loss(loss)
        cfg = self.config
        parts.path.begin_backward(cfg.managed_gradient_accumulation and self.is_gradient_accumulation_boundary())
        # R5: the same division a user writes as ``loss / gas``, in the loss dtype.
        scaled = loss / cfg.gradient_accumulation_steps if scale_wrt_gas else loss
        before, self._phase = self._phase, GradientPhase.IN_BACKWARD
        completed = False
        try:
            parts.grads.run(scaled.backward)
            completed = True
        finally:
            # a backward that raised leaves the phase it found (what it added before failing, zero_grad() drops)
            self._phase = GradientPhase.ACCUMULATED if completed else before
            self._model.clear_grads()
            if parts.stage3 is not None:
                parts.stage3.release_all()
        self._schedule.backward_done()

    def step(self) -> StepOutcome:
        """R2-R4 / R6 and, at a boundary, the epilogue R13 with the hyper-parameters of ``optimizer``'s group;
        then an attached ``lr_scheduler`` steps (boundaries only, as DeepSpeed steps it)."""
        path = self._check_alive().path
        path.before_step()
        with self._schedule.step() as boundary:
            outcome = (
                path.boundary(self.optimizer.current(), self.record_gradients)
                if boundary else StepOutcome(boundary=False)
            )
        if boundary:
            self._phase = GradientPhase.CLEAN
            self._lr.boundary_done()
        return outcome

    def zero_grad(self) -> None:
        """Discard the gradient accumulated since the last boundary (counters unchanged). Gradients never stay
        on ``p.grad`` (the engine moves them into its buffers during backward), so this is all there is to
        clear; at a boundary ``step()`` already clears it (R13 step 6)."""
        path = self._check_alive().path
        if self._in_backward():
            raise UnsupportedOperationError("zero_grad() was called during backward(); allowed: call it between calls")
        path.zero_grad()
        self._model.clear_grads()
        self._phase = GradientPhase.CLEAN

    # ---- checkpoints (:mod:`.checkpoint` reads and writes them) -----------------------------------------------
    def save_checkpoint(
        self, save_dir: str | os.PathLike, tag: str | None = None, client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
    ) -> str:
        """Save this rank's fp32 master range, optimizer state, frozen parameters, buffers, counters, optimizer
        hyper-parameters, lr_scheduler state, RNG and ``client_state`` (plain data: tensors, numbers, strings,
        containers) under ``save_dir/tag`` (default ``global_step<N>``). Every rank calls it with the same
        arguments (a collective). Atomic: files are staged in a hidden directory that becomes ``save_dir/tag``
        with one rename after every rank's file and the manifest are on disk; a save that dies half-way leaves
        nothing :meth:`load_checkpoint` would load. Refused inside backward() or no_sync(), and after a backward()
        without a boundary step() (the accumulated gradient would be lost). Returns the checkpoint's path."""
        return ckpt.save(self._checkpoint_view(), save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self, load_dir: str | os.PathLike, tag: str | None = None, *, load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """Load a checkpoint :meth:`save_checkpoint` wrote, at this engine's world size and stage whatever they
        were at save time (each rank assembles its range from the files that overlap it). ``tag=None`` reads
        ``load_dir/latest``. Every rank calls it (a collective). Everything is read and checked first, every
        rank agrees, and only then does the engine change, so a :class:`CheckpointError` (missing, partial or
        foreign checkpoint) leaves it as it was. ``load_module_only``: weights only (DeepSpeed's flag). RNG
        states are restored on ranks that existed in the saved run. Returns ``(path, client_state)``."""
        return ckpt.load(
            self._checkpoint_view(), load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
        )

    def _in_backward(self) -> bool:
        return self._phase is GradientPhase.IN_BACKWARD

    def _gradients_dropped(self) -> None:
        """A checkpoint load (or ``load_state_dict``) installed new state: what was accumulated is gone."""
        self._phase = GradientPhase.CLEAN

    def _checkpoint_view(self) -> CheckpointView:
        """What checkpoint code sees of this engine once its update is complete (per call: it says where we are)."""
        parts = self._check_alive(synchronize=True)
        return CheckpointView(
            comm=self._comm, rank=self.rank, world_size=self.world_size, stage=self.stage, device=self.device,
            config=self.config, layout=self.layout, frozen_layout=self.frozen_layout, frozen_names=self.frozen_names,
            module=self.module, params=self._model.params, weights=parts.weights, path=parts.path,
            schedule=self._schedule, optimizer=self.optimizer, lr_schedule=self._lr,
            gradients_dropped=self._gradients_dropped, in_backward=self._in_backward(),
            in_no_sync=self._schedule.in_no_sync, grads_pending=self._phase is GradientPhase.ACCUMULATED,
        )

    # ---- consolidated weights ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every parameter at full shape in the model dtype (stage 3: gathered, a
        collective every rank calls) and this rank's buffers: what a plain ``nn.Module`` loads."""
        return ckpt.module_state_dict(self.module, self.full_parameters())

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load full parameters (any float dtype: an fp32 state_dict fills the fp32 masters exactly, the model
        gets their cast) and buffers from a plain ``state_dict``; optimizer state and counters are kept. Every
        rank passes the same state_dict; no communication. Checked before anything changes: with ``strict``
        the keys must be the module's exactly; shapes must always match."""
        ckpt.load_module_state(self._checkpoint_view(), state_dict, strict)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter at full shape in the model dtype (stage 3: a collective, all ranks call)."""
        stage3 = self._check_alive(synchronize=True).stage3
        if stage3 is None:
            return {n: p.detach().clone() for n, p in self._model.params.items()}
        out = stage3.full_parameters()
        return {n: out[n].clone() for n in self.parameter_names}

    def master_partition(self) -> torch.Tensor:
        """This rank's fp32 master (whole at stage 0), a copy."""
        return self._check_alive(synchronize=True).path.master.clone()

    def optimizer_state(self) -> OptimizerState:
        """A copy of this rank's optimizer state (with ``nvme`` offload: read back from its files)."""
        return self._check_alive(synchronize=True).path.optimizer_state()

    def destroy(self) -> None:
        """Remove every hook, unpin every pinned buffer the engine allocated, close the ``nvme`` swap handle and
        delete its files, and drop all state. Never communicates, so it is safe after another rank failed. The
        engine cannot be used afterwards."""
        self._parts.close()

    def synchronize(self) -> None:
        """Wait until the last boundary's update is complete and visible to the current stream.

        With ``offload_optimizer: cpu`` at stages 2/3 (world size 1, or stage 3) ``step()`` returns while the
        CPU Adam of later buckets still runs and their weights are still being copied to the device; each
        module's forward waits for its own parameters, and every engine method that reads weights or optimizer
        state calls this first. Call it yourself before reading a parameter tensor some other way (a reference
        to ``p.data`` kept from before ``step()``, a hook of your own) between ``step()`` and the next forward.
        A no-op when nothing is in flight; re-raises an error of the update."""
        self._parts.synchronize()

    def apply_delayed_update(self) -> None:
        """R27 (``delayed_parameter_update``): let the last boundary's update reach the parameters now instead of
        at the next boundary -- before exporting or evaluating the final weights, or after each of the first
        steps of a warm-up. Waits for the update; a collective at stage 2 with several ranks (every rank calls
        it). A no-op without the delayed update, where the parameters already are the cast of the master."""
        parts = self._check_alive()
        if self._in_backward():
            raise UnsupportedOperationError(
                "apply_delayed_update() was called during backward(); allowed: call it between calls"
            )
        parts.path.synchronize()
        parts.path.apply_delayed()

    def _check_alive(self, synchronize: bool = False) -> LiveParts:
        """Refuse a destroyed engine (the hook :class:`ScheduledEngine`'s calls use too); else the engine's parts,
        with ``synchronize`` once the update in flight is complete."""
        parts = self._parts.live()  # raises once destroyed
        if synchronize:
            parts.path.synchronize()
        return parts

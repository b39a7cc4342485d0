"""The ZeRO data-parallel engine on torch.distributed (stages 0-3, managed and unmanaged accumulation, offload).

One instance per rank, like DeepSpeed's engine: each process wraps its model, calls ``backward(loss)`` and
``step()``, and the engine does the communication through a ``torch.distributed`` process group (gloo on CPU,
NCCL on GPUs; world size 1 works). The semantics are docs/accumulation.md's, rule for rule, and the arithmetic is
the reference's: on the host the trace of a scenario equals the reference trace bitwise at every world size
(reductions are rank-ordered, see :mod:`optimized.accumulation.collectives`; the optimizer is the R16 formula,
natively, see :mod:`optimized.cpu_adam`).

This class is the training surface and the schedule; what happens where is in modules of its own:

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
  and committed by one rename, loadable at any world size, stage and update path).

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

import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optimized.accumulation import checkpoint as ckpt
from optimized.accumulation.checkpoint_view import CheckpointView
from optimized.accumulation.collectives import HANDOFF, Collectives
from optimized.accumulation.construction import build_module, check_same_model_on_every_rank, resolve_device
from optimized.accumulation.gradients import GradientHooks, plan_buckets
from optimized.accumulation.host_buffers import HostBuffers
from optimized.accumulation.lr import EngineOptimizer
from optimized.accumulation.origin import LossOrigin
from optimized.accumulation.partition import FlatLayout, build_layout
from optimized.accumulation.stage3 import Stage3Parameters
from optimized.accumulation.update_paths import UpdateContext, UpdatePath, update_path_class
from optimized.accumulation.weights import LiveWeights
from reference.contract import envvars
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_schedule import AccumulationSchedule, ScheduledEngine
from reference.contract.accumulation_step import OptimizerState, StepOutcome
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "StepOutcome", "ZeroEngine"]

#: Elements per gradient bucket at stages 2/3 (25M, as DeepSpeed's default reduce_bucket_size).
DEFAULT_BUCKET_ELEMENTS = 25_000_000


#: module -> weak reference to the live engine that wraps it (a module is owned by at most one engine).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
#: modules whose stage-3 parameters a destroyed engine left without data.
_RELEASED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
def _check_not_owned(module: nn.Module) -> None:
    """A module (or any of its sub-modules) already wrapped by a live engine cannot be wrapped again: at stage 3
    the first engine's hooks and partitions would fight the second's over the same parameters."""
    for m in module.modules():
        ref = _OWNERS.get(m)
        owner = ref() if ref is not None else None
        if owner is not None and not owner._destroyed:
            what = "the model" if m is module else f"sub-module {type(m).__name__} of the model"
            raise ConfigurationError(
                f"model: {what} is already wrapped by another ZeroEngine (zero_stage={owner.stage}, rank "
                f"{owner.rank}); allowed: call destroy() on that engine first, or wrap a separate model"
            )
        if m in _RELEASED and any(p.numel() == 0 for p in m.parameters(recurse=False)):
            raise ConfigurationError(
                "model: its parameters were released by a destroyed zero_stage=3 engine and hold no data; allowed: "
                "a model with its parameters (load them back, e.g. from the old engine's state_dict())"
            )


def _check_engine_arguments(bucket_elements: object, record_gradients: object, prefetch: object) -> None:
    if type(bucket_elements) is not int or bucket_elements < 1:
        raise ConfigurationError(f"bucket_elements={bucket_elements!r} must be an int >= 1")
    for name, value in (("record_gradients", record_gradients), ("prefetch", prefetch)):
        if type(value) is not bool:
            raise ConfigurationError(f"{name}={value!r} must be a bool; allowed values: True, False")
    # Every engine refuses a bad HOSTOFFLOAD_DEVICE_ADAM, not only those whose update path steps a master on the
    # device (which decide at construction, device_adam.prepare): a typo must not wait for a config change.
    envvars.device_adam()


class ZeroEngine(ScheduledEngine):
    """One rank of a ZeRO data-parallel run of ``model`` under ``config`` (docs/accumulation.md, docs/zero.md).

    ``model``: an ``nn.Module`` (used in place, cast to the model dtype and moved to ``device``) or a factory.
    ``process_group``: default the world group. ``device``: default ``cuda:<current>`` with NCCL, else cpu.
    ``record_gradients``: return the full reduced gradient from boundary steps (an extra all-gather; the
    conformance runner uses it). ``bucket_elements``: stage-2/3 bucket size. ``prefetch``: stage-3 prefetch
    of the next module's parameters (one module ahead in forward, one behind in backward).
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        config: AccumulationConfig | Mapping[str, Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        record_gradients: bool = False,
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
        prefetch: bool = True,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if initialized else None
        # DeepSpeed's nested shape is accepted too; train_batch_size is checked against (or completes the batch
        # keys from) this group's world size.
        self.config = cfg = AccumulationConfig.from_dict(config, world_size=world)
        if cfg.pipeline_parallel_size != 1:
            raise UnsupportedOperationError(
                f"pipeline_parallel_size={cfg.pipeline_parallel_size} is not modeled by this engine "
                f"(data parallelism only); allowed: pipeline_parallel_size=1"
            )
        if not initialized:
            raise ConfigurationError(
                "torch.distributed is not initialized; allowed: call torch.distributed.init_process_group "
                "(backend 'gloo' on CPU, 'nccl' on GPUs; world size 1 is fine) before building the engine"
            )
        _check_engine_arguments(bucket_elements, record_gradients, prefetch)
        self._comm = Collectives(process_group)
        self.world_size = self._comm.world
        self.rank = self._comm.rank
        self.stage = cfg.zero_stage
        self.device = resolve_device(device, process_group)
        self.record_gradients = record_gradients
        self.prefetch = prefetch
        self._bucket_elements = bucket_elements
        module = build_module(model)
        _check_not_owned(module)
        #: The one place the offload configuration is decoded (update_paths.py); the path is built below.
        path_class = update_path_class(cfg)
        path_class.check_config(cfg)
        self._module = module.to(device=self.device, dtype=cfg.model_dtype)
        named = list(self._module.named_parameters())
        check_same_model_on_every_rank(self._comm, named)  # before any buffer: a mismatch fails on every rank
        trainable = [(n, p) for n, p in named if p.requires_grad]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        if not trainable:
            raise ConfigurationError("model has no parameter with requires_grad=True; allowed: at least one")
        self.parameter_names = tuple(n for n, _ in named)
        self.trainable_names = tuple(n for n, _ in trainable)
        self.frozen_names = tuple(n for n, _ in frozen)
        self._params: dict[str, nn.Parameter] = dict(named)
        self.layout: FlatLayout = build_layout([(n, p.shape) for n, p in trainable], self.world_size)
        self.frozen_layout: FlatLayout = build_layout([(n, p.shape) for n, p in frozen], self.world_size)

        self._host = HostBuffers()
        self._path: UpdatePath | None = None
        self._stage3: Stage3Parameters | None = None
        self._hooks: list[Any] = []
        self._in_backward = False
        self._destroyed = False
        self._schedule = AccumulationSchedule(self.config, self.world_size, self.stage)
        #: Whether gradients were accumulated since the last boundary (save_checkpoint refuses to drop them).
        self._grads_pending = False
        #: What makes a loss this engine's (R20: a foreign loss is rejected before anything is accumulated).
        self._origin = LossOrigin(p for _, p in trainable)
        self._lr_scheduler: Any = None
        self._pending_scheduler_state: dict[str, Any] | None = None
        self._owned_modules = list(self._module.modules())
        try:
            self._build(path_class)
            self._hooks.append(self._module.register_forward_hook(self._mark_outputs))
            #: The torch.optim.Optimizer facade LR schedules are built on (docs/zero.md, "LR schedules").
            self.optimizer = EngineOptimizer([p for _, p in trainable], cfg.optimizer)
        except BaseException:
            self.destroy()
            raise
        for m in self._owned_modules:
            _OWNERS[m] = weakref.ref(self)

    # ---- construction --------------------------------------------------------------------------------------
    def _build(self, path_class: type[UpdatePath]) -> None:
        """The parameters' storage, the gradient buckets, the update path, then the hooks that connect them."""
        cfg = self.config
        self._weights = LiveWeights(
            stage=self.stage, rank=self.rank, layout=self.layout, frozen_layout=self.frozen_layout,
            device=self.device, comm=self._comm, params=self._params, host=self._host,
            offload_param=cfg.offload_param == "cpu", model_dtype=cfg.model_dtype,
        )
        buckets = plan_buckets(self.layout, self._bucket_elements) if self.stage >= 2 else []
        self._path = path_class(UpdateContext(
            config=cfg, layout=self.layout, rank=self.rank, world_size=self.world_size, stage=self.stage,
            device=self.device, comm=self._comm, weights=self._weights, host=self._host, buckets=buckets,
            boundaries_done=lambda: self._schedule.global_steps, hyper_now=lambda: self.optimizer.current(),
        ))
        self._weights.drop_initial()
        trainable_of = {id(self._params[n]): n for n in self.trainable_names}
        self._path.install_forward_waits(self._module, trainable_of, self._hooks.append)
        self._grads = GradientHooks(
            stage=self.stage, layout=self.layout, comm=self._comm, accum_dtype=cfg.accum_dtype, buckets=buckets,
            in_backward=lambda: self._in_backward,
        )
        self._grads.attach(self._path, self._params, self._hooks.append)
        if self.stage == 3:
            self._stage3 = Stage3Parameters(
                module=self._module, params=self._params, layout=self.layout, frozen_layout=self.frozen_layout,
                weights=self._weights, comm=self._comm, device=self.device, model_dtype=cfg.model_dtype,
                prefetch=self.prefetch, in_backward=lambda: self._in_backward,
                wait_update=self._path.wait_range, add_hook=self._hooks.append,
            )

    @property
    def master_device(self) -> torch.device:
        """Where this rank's fp32 master lives (the host with optimizer offload, R17)."""
        return self._path.master.device

    @property
    def param_device(self) -> torch.device:
        """Where stage-3 parameter partitions live (the host with ``offload_param``)."""
        return self._weights.param_device

    @property
    def prefetch_hits(self) -> int:
        """Stage-3 gathers that found their parameters already prefetched (for tests and tuning)."""
        return 0 if self._stage3 is None else self._stage3.prefetch_hits

    # ---- public surface ------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (call it, or the engine, for the forward)."""
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        return self._module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Back-propagate this rank's ``loss`` and accumulate (R5, R7, R9, R10)."""
        self._check_alive()
        if type(scale_wrt_gas) is not bool:
            raise ConfigurationError(f"scale_wrt_gas={scale_wrt_gas!r} must be a bool; allowed values: True, False")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ConfigurationError("loss must be a one-element tensor that requires grad")
        if not self._origin.produced(loss):
            raise ConfigurationError(
                "loss was not computed from this engine's module: its autograd graph reaches neither a trainable "
                "parameter nor an output of engine.module (a loss of another model, or of a detached output, "
                "would be accumulated as a zero gradient); allowed: a loss computed from engine(...) / "
                "engine.module(...) outputs"
            )
        managed = self.config.managed_gradient_accumulation
        self._path.begin_backward(managed and self.is_gradient_accumulation_boundary())
        if self.stage >= 2:
            self._grads.begin()
        self._in_backward = True
        finished = False
        try:
            # R5: the same division a user writes as ``loss / gas``, in the loss dtype.
            (loss / self.config.gradient_accumulation_steps if scale_wrt_gas else loss).backward()
            if self.stage >= 2:
                self._grads.finish()
            finished = True
        finally:
            self._in_backward = False
            for p in self._params.values():
                p.grad = None
            if self._stage3 is not None:
                self._stage3.release_all()
            if not finished:
                self._grads.abandon()
        self._grads_pending = True
        self._schedule.backward_done()

    def step(self) -> StepOutcome:
        """R2-R4 / R6 and, at a boundary, the epilogue R13 with the hyper-parameters of ``optimizer``'s group;
        then an attached ``lr_scheduler`` steps (boundaries only, as DeepSpeed steps it)."""
        self._check_alive()
        self._path.before_step()
        with self._schedule.step() as boundary:
            outcome = (
                self._path.boundary(self.optimizer.current(), self.record_gradients)
                if boundary else StepOutcome(boundary=False)
            )
        if boundary:
            self._grads_pending = False
            self.optimizer.engine_step()
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
        return outcome

    def _mark_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        self._origin.mark_outputs(output)

    # ---- counters and the boundary (R2-R6, R18, R20): micro_steps, global_steps, global_samples,
    # is/set_gradient_accumulation_boundary and no_sync are the contract's ScheduledEngine (inherited) ----------

    # ---- the usual module surface ----------------------------------------------------------------------------
    def train(self, mode: bool = True) -> ZeroEngine:
        """``module.train(mode)``; returns the engine."""
        self._module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        """``module.eval()``; returns the engine."""
        self._module.eval()
        return self

    @property
    def training(self) -> bool:
        return self._module.training

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (at stage 3 between forwards they hold no data: shape ``[0]``); waits for
        an update still streaming in (:meth:`synchronize`)."""
        self.synchronize()
        return self._module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self.synchronize()
        return self._module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Discard the gradient accumulated since the last boundary (counters unchanged). Gradients never stay
        on ``p.grad`` (the engine moves them into its buffers during backward), so this is all there is to
        clear; at a boundary ``step()`` already clears it (R13 step 6)."""
        self._check_alive()
        if self._in_backward:
            raise UnsupportedOperationError("zero_grad() was called during backward(); allowed: call it between calls")
        self._path.zero_grad()
        for p in self._params.values():
            p.grad = None
        self._grads_pending = False
    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group of ``optimizer`` (one group)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group; used from the next boundary on."""
        if not isinstance(lr, (int, float)) or type(lr) is bool or not math.isfinite(lr) or lr < 0:
            raise ConfigurationError(f"lr={lr!r} must be a finite number >= 0")
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler ``step()`` advances at each boundary (None: none). Assign one built on
        ``engine.optimizer``; a scheduler state loaded by :meth:`load_checkpoint` before one was attached is
        applied to it on assignment."""
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        if scheduler is not None:
            if getattr(scheduler, "optimizer", None) is not self.optimizer or not callable(
                getattr(scheduler, "step", None)
            ):
                raise ConfigurationError(
                    f"lr_scheduler={scheduler!r} must be a scheduler built on engine.optimizer (e.g. "
                    f"torch.optim.lr_scheduler.LambdaLR(engine.optimizer, ...)), or None"
                )
            if self._pending_scheduler_state is not None:
                scheduler.load_state_dict(self._pending_scheduler_state)
                self._pending_scheduler_state = None
                # Building the scheduler reset the group's lr to its first value; the loaded one is in force.
                for g, lr in zip(self.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                    g["lr"] = lr
        self._lr_scheduler = scheduler

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
        nothing :meth:`load_checkpoint` would load. Returns the checkpoint's path."""
        self._check_alive()
        self.synchronize()
        if self._in_backward or self._schedule._in_no_sync:
            raise UnsupportedOperationError(
                "save_checkpoint() inside backward() or no_sync(); allowed: call it between steps"
            )
        if self._grads_pending:
            raise UnsupportedOperationError(
                "save_checkpoint() after backward() without a boundary step(): the accumulated gradient is not "
                "part of a checkpoint and would be lost; allowed: save right after a boundary step(), or "
                "zero_grad() first to drop it on purpose"
            )
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
        self._check_alive()
        self.synchronize()
        if self._in_backward or self._schedule._in_no_sync:
            raise UnsupportedOperationError("load_checkpoint() inside backward() or no_sync(); allowed: between steps")
        for name, v in (("load_optimizer_states", load_optimizer_states),
                        ("load_lr_scheduler_states", load_lr_scheduler_states), ("load_module_only", load_module_only)):
            if type(v) is not bool:
                raise ConfigurationError(f"{name}={v!r} must be a bool; allowed values: True, False")
        return ckpt.load(
            self._checkpoint_view(), load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
        )

    def _checkpoint_view(self) -> CheckpointView:
        """What checkpoint save and load see of this engine (built per call: the attached scheduler may change)."""

        def defer_scheduler_state(state: dict[str, Any]) -> None:
            self._pending_scheduler_state = state

        def gradients_dropped() -> None:
            self._grads_pending = False

        return CheckpointView(
            comm=self._comm, rank=self.rank, world_size=self.world_size, stage=self.stage, device=self.device,
            config=self.config, layout=self.layout, frozen_layout=self.frozen_layout, frozen_names=self.frozen_names,
            module=self._module, params=self._params, weights=self._weights, path=self._path,
            schedule=self._schedule, optimizer=self.optimizer, lr_scheduler=self._lr_scheduler,
            defer_scheduler_state=defer_scheduler_state, gradients_dropped=gradients_dropped,
        )

    # ---- consolidated weights ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every parameter at full shape in the model dtype (stage 3: gathered, a
        collective every rank calls) and this rank's buffers: what a plain ``nn.Module`` loads."""
        self._check_alive()
        self.synchronize()
        full = self.full_parameters()
        out = {}
        for k, v in self._module.state_dict(keep_vars=True).items():
            out[k] = full[k] if k in full else v.detach().clone()
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load full parameters (any float dtype: an fp32 state_dict fills the fp32 masters exactly, the model
        gets their cast) and buffers from a plain ``state_dict``; optimizer state and counters are kept. Every
        rank passes the same state_dict; no communication. Checked before anything changes: with ``strict``
        the keys must be the module's exactly; shapes must always match."""
        self._check_alive()
        self.synchronize()
        if self._in_backward:
            raise UnsupportedOperationError("load_state_dict() during backward(); allowed: call it between calls")
        if not isinstance(state_dict, Mapping):
            raise ConfigurationError(f"state_dict={type(state_dict).__name__} must be a mapping name -> tensor")
        buffers = dict(self._module.named_buffers())
        expected = set(self.parameter_names) | set(buffers)
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise ConfigurationError(
                f"state_dict does not match the module: missing keys {missing}, unexpected keys {unexpected}; "
                f"allowed: the keys of engine.state_dict(), or strict=False"
            )
        shapes = {s.name: s.shape for s in (*self.layout.segments, *self.frozen_layout.segments)}
        for k, v in state_dict.items():
            want = shapes.get(k, tuple(buffers[k].shape) if k in buffers else None)
            if want is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(want)):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ConfigurationError(f"state_dict[{k!r}] has shape {got}; the module's is {tuple(want)}")
        master = self._path.master.clone()
        lo = 0 if self.stage == 0 else self.rank * self.layout.partition_size
        hi = lo + master.numel()
        for name, pstart, local, length in ckpt.pieces_of_range(self.layout.segments, lo, hi):
            if name in state_dict:
                flat = state_dict[name].detach().reshape(-1).to(torch.float32)
                master[local : local + length].copy_(flat[pstart : pstart + length])
        frozen = {k: state_dict[k] for k in self.frozen_names if k in state_dict}
        loaded_buffers = {k: v for k, v in state_dict.items() if k in buffers}
        ckpt.install_state(self._checkpoint_view(), master, None, frozen, loaded_buffers)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter at full shape in the model dtype (stage 3: a collective, all ranks call)."""
        self._check_alive()
        self.synchronize()
        if self._stage3 is None:
            return {n: p.detach().clone() for n, p in self._params.items()}
        out = self._stage3.full_parameters()
        return {n: out[n].clone() for n in self.parameter_names}

    def master_partition(self) -> torch.Tensor:
        """This rank's fp32 master (whole at stage 0), a copy."""
        self._check_alive()
        self.synchronize()
        return self._path.master.clone()

    def optimizer_state(self) -> OptimizerState:
        """A copy of this rank's optimizer state (with ``nvme`` offload: read back from its files)."""
        self._check_alive()
        self.synchronize()
        return self._path.optimizer_state()

    def pinned_buffers(self) -> tuple[torch.Tensor, ...]:
        """The pinned host buffers this engine holds now (offload state, and ``nvme`` state buffers while they
        are in memory), for inspection."""
        return self._host.pinned + (self._path.reports.resident_buffers() if self._path is not None else ())

    @property
    def swap_directory(self) -> str | None:
        """The directory this rank swaps optimizer state into (``nvme`` offload), else None."""
        return None if self._path is None else self._path.reports.swap_directory

    def swap_stats(self):
        """The swap handle's :class:`~reference.io.SwapStats` (``nvme`` offload), else None."""
        return None if self._path is None else self._path.reports.swap_stats()

    def destroy(self) -> None:
        """Remove every hook, unpin every pinned buffer the engine allocated, close the ``nvme`` swap handle and
        delete its files, and drop all state. Never communicates, so it is safe after another rank failed. The
        engine cannot be used afterwards."""
        HANDOFF.drain()  # the transport's threads let go of this engine's tensors before they are unpinned
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self.__dict__.get("_owned_modules", ()):
            ref = _OWNERS.get(m)
            if ref is not None and ref() is self:
                del _OWNERS[m]
        if self.stage == 3 and "_module" in self.__dict__:
            _RELEASED.add(self._module)
        path, self._path = self.__dict__.get("_path"), None
        if path is not None:
            # never raises: lets a worker finish (it writes into buffers unpinned below), closes a swap handle
            path.close()
        for attr in ("_weights", "_stage3"):
            part = self.__dict__.pop(attr, None)
            if part is not None:
                part.close()
        self.__dict__.pop("_grads", None)
        del path, part
        self._stage3 = None
        if "_host" in self.__dict__:
            self._host.release()
        self._destroyed = True

    # ---- an update in flight ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until the last boundary's update is complete and visible to the current stream.

        With ``offload_optimizer: cpu`` at stages 2/3 (world size 1, or stage 3) ``step()`` returns while the
        CPU Adam of later buckets still runs and their weights are still being copied to the device; each
        module's forward waits for its own parameters, and every engine method that reads weights or optimizer
        state calls this first. Call it yourself before reading a parameter tensor some other way (a reference
        to ``p.data`` kept from before ``step()``, a hook of your own) between ``step()`` and the next forward.
        A no-op when nothing is in flight; re-raises an error of the update."""
        path = self.__dict__.get("_path")
        if path is not None:
            path.synchronize()

    def apply_delayed_update(self) -> None:
        """R27 (``delayed_parameter_update``): let the last boundary's update reach the parameters now instead of
        at the next boundary -- before exporting or evaluating the final weights, or after each of the first
        steps of a warm-up. Waits for the update; a collective at stage 2 with several ranks (every rank calls
        it). A no-op without the delayed update, where the parameters already are the cast of the master."""
        self._check_alive()
        if self._in_backward:
            raise UnsupportedOperationError(
                "apply_delayed_update() was called during backward(); allowed: call it between calls"
            )
        self.synchronize()
        self._path.apply_delayed()

    def offload_timings(self) -> dict[str, float] | None:
        """Where the streamed offloaded update spent its time since the last call (seconds: ``cpu_adam_s``,
        ``wait_s`` -- the training thread blocked on it --, ``d2h_s``, ``h2d_s`` ...; without offload on a GPU
        only ``device_adam_s``), or None where there is nothing to report (a cpu run without offload, a host update
        that is not streamed: stage 0/1, SGD). Synchronizes; meant for benchmarks."""
        path = self.__dict__.get("_path")
        return None if path is None else path.reports.offload_timings()

    def split_report(self) -> dict | None:
        """R28 (``gpu_share``): this rank's cut between the device and the host -- the share, elements, device
        bytes and, for ``"auto"``, the budget and the measurement it chose from
        (``reference.contract.accumulation_split.SplitDecision`` as a mapping) -- or None (``gpu_share`` 0, or
        "auto" before the second boundary)."""
        path = self.__dict__.get("_path")
        return None if path is None else path.reports.split_report()

    def overlap_report(self) -> dict[str, int] | None:
        """R30 (``host_update_start: last_backward``): counts since construction -- ``boundaries_speculated``
        (boundaries whose update started under their last backward), ``buckets_speculated``,
        ``boundaries_redone`` / ``buckets_redone`` (settled by restoring the untouched state and updating again:
        the norm clipped, or the hyper-parameters changed before the step) and ``speculations_discarded`` (no step
        followed the predicted boundary's backward) -- or None (``host_update_start: step``). Waits for the update
        in flight."""
        path = self.__dict__.get("_path")
        return None if path is None else path.reports.overlap_report()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise UnsupportedOperationError("the engine was destroyed; allowed: build a new ZeroEngine")

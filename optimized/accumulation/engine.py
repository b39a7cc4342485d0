"""The ZeRO data-parallel engine on torch.distributed (stages 0-3, managed and unmanaged accumulation, offload).

One instance per rank, like DeepSpeed's engine: each process wraps its model, calls ``backward(loss)`` and
``step()``, and the engine does the communication through a ``torch.distributed`` process group (gloo on CPU,
NCCL on GPUs; world size 1 works). The semantics are docs/accumulation.md's, rule for rule, and the arithmetic is
the reference's: on the host the trace of a scenario equals the reference trace bitwise at every world size
(reductions are rank-ordered, see :mod:`optimized.accumulation.collectives`; the optimizer is the R16 formula,
natively, see :mod:`optimized.cpu_adam`).

What happens where, per stage (R9-R12):

- Stages 0/1: each backward adds every parameter's gradient into a flat accumulation buffer straight from a
  post-accumulate-grad hook (``p.grad`` is dropped at once, so no second full-size gradient copy lives on).
  The boundary ``step()`` reduces it once (rank-ordered reduce-scatter; stage 0 all-gathers the result).
- Stages 2/3: the hook copies the gradient into a flat communication buffer; when the last gradient of a bucket
  has arrived the bucket's reduce-scatter is launched asynchronously (gloo's worker threads, or NCCL's stream),
  so it overlaps the rest of backward; ``backward()`` waits for the buckets at its end and adds this rank's
  reduced slices into its partition accumulator.
- Stage 3: parameters hold no data between uses; a module's parameters are gathered (broadcast from the ranks
  owning each piece of the R8 layout) before its forward -- with the next module's gather prefetched --
  released after it, gathered again when the gradient reaches the module's output (prefetching the module
  before it) and by any checkpoint recompute (R21), and all released when ``backward()`` returns.
- Offload (R17): the fp32 master and optimizer state live in pinned host buffers from the project's pinning
  API; gradients are copied device-to-host asynchronously, the native CPU Adam runs the step (writing the bf16
  weights in the same pass), the weights go back asynchronously. At stages 2/3 with Adam this is streamed per
  bucket (:mod:`optimized.accumulation.streamed_update`): the D2H overlaps backward, the fp32 accumulator stays
  on the host, and the CPU Adam overlaps the next forward, whose modules wait only for their own buckets; with
  the opt-in ``delayed_parameter_update`` (R27) it overlaps the whole next step, which computes with the weights
  of the boundary before (published into the parameters at each boundary, before that boundary's update).
  ``offload_param`` keeps stage-3 partitions in
  pinned host memory. ``offload_optimizer: nvme`` is ``cpu`` with the optimizer state in files between steps:
  read back (asynchronously, from the start of the boundary) before the CPU Adam, written after it
  (:mod:`optimized.accumulation.swap`).

What a training script uses besides backward()/step() (docs/zero.md): ``engine.optimizer``, a
``torch.optim.Optimizer`` facade whose group values the boundary update reads (:mod:`.lr`), so any
``torch.optim.lr_scheduler`` drives it (``engine.lr_scheduler`` is stepped at boundaries); ``save_checkpoint`` /
``load_checkpoint`` (per-rank files in parameter coordinates, staged and committed by one rename, loadable at any
world size and stage: :mod:`.checkpoint`); the consolidated ``state_dict()`` / ``load_state_dict()``;
``zero_grad``, ``train``/``eval``, ``parameters``. Misuse is refused at the call, before anything changes: a loss
whose graph reaches neither this model's outputs nor its trainable parameters, a model (or sub-module) another
live engine wraps, an ``nvme_path`` where no file can be created.

Failure: a rank that raises stops calling collectives; the others fail in their next collective after the
process group's timeout with :class:`~optimized.accumulation.collectives.CollectiveError` (never a silent hang
longer than that timeout). After any error call :meth:`ZeroEngine.destroy` (it never communicates) and build a
new engine.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optimized.accumulation import checkpoint as ckpt
from optimized.accumulation.collectives import Collectives, PendingReduce
from optimized.accumulation.lr import EngineOptimizer
from optimized.accumulation.optimizers import step_master, uses_native
from optimized.accumulation.origin import LossOrigin, tensors_in
from optimized.accumulation.partition import FlatLayout, build_layout, owners, unflatten
from optimized.accumulation.streamed_update import StreamedUpdate
from optimized.accumulation.swap import StateSwapper
from optimized.pinning import pin_empty, unpin
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_schedule import AccumulationSchedule, ScheduledEngine
from reference.contract.accumulation_step import CLIP_EPSILON, OptimizerState, StepOutcome
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


def _probe_nvme_path(path: str) -> None:
    """R19 says ``nvme_path`` must be an existing *writable* directory; write permission cannot be read off the
    mode bits (root, read-only mounts, ACLs), so create and remove a file there now, at construction."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".hostoffload-probe-", dir=path)
    except OSError as exc:
        raise ConfigurationError(
            f"nvme_path={path!r} is not usable: creating a file there failed ({exc.strerror or exc}); "
            f"allowed: an existing directory this process can write (offload_optimizer='nvme' swaps the "
            f"optimizer state into files there)"
        ) from exc
    os.close(fd)
    os.unlink(probe)


@dataclass
class _Bucket:
    """A contiguous range of the flat gradient buffer reduced by one collective (stages 2/3)."""

    start: int
    end: int
    names: tuple[str, ...]
    splits: list[int]
    index: int = 0
    pending: int = 0
    reduce: PendingReduce | None = None
    keep_alive: torch.Tensor | None = None
    #: streamed offload: this backward's gradients of the bucket (comm dtype, zeros where none arrived), allocated
    #: at its first gradient and dropped once reduced, instead of a view of a model-sized flat buffer
    grads: torch.Tensor | None = None


@dataclass
class _Unit:
    """The parameters a module owns directly (stage 3 gathers per module)."""

    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    gathered: bool = False
    prefetched: list[Any] = field(default_factory=list)


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
        if type(bucket_elements) is not int or bucket_elements < 1:
            raise ConfigurationError(f"bucket_elements={bucket_elements!r} must be an int >= 1")
        for name, value in (("record_gradients", record_gradients), ("prefetch", prefetch)):
            if type(value) is not bool:
                raise ConfigurationError(f"{name}={value!r} must be a bool; allowed values: True, False")
        self._comm = Collectives(process_group)
        self.world_size = self._comm.world
        self.rank = self._comm.rank
        self.stage = cfg.zero_stage
        self.device = self._resolve_device(device, process_group)
        self.record_gradients = record_gradients
        self.prefetch = prefetch
        self._bucket_elements = bucket_elements
        #: Stage-3 gathers that found their parameters already prefetched (for tests and tuning).
        self.prefetch_hits = 0
        module = model if isinstance(model, nn.Module) else model()
        if not isinstance(module, nn.Module):
            raise ConfigurationError(f"model={model!r} must be an nn.Module or a factory returning one")
        _check_not_owned(module)
        if cfg.offload_optimizer == "nvme":
            _probe_nvme_path(cfg.nvme_path)
        self._module = module.to(device=self.device, dtype=cfg.model_dtype)
        named = list(self._module.named_parameters())
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
        self._segments = {s.name: s for s in self.layout.segments}
        self._frozen_segments = {s.name: s for s in self.frozen_layout.segments}
        self.master_device = torch.device("cpu") if cfg.masters_on_host else self.device
        self.param_device = torch.device("cpu") if cfg.offload_param == "cpu" else self.device

        self._pinned: list[torch.Tensor] = []
        self._swap: StateSwapper | None = None
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
            self._build_buffers(trainable, frozen)
            self._hooks.append(self._module.register_forward_hook(self._mark_outputs))
            #: The torch.optim.Optimizer facade LR schedules are built on (docs/zero.md, "LR schedules").
            self.optimizer = EngineOptimizer([p for _, p in trainable], cfg.optimizer)
        except BaseException:
            self.destroy()
            raise
        for m in self._owned_modules:
            _OWNERS[m] = weakref.ref(self)

    # ---- construction --------------------------------------------------------------------------------------
    @staticmethod
    def _resolve_device(device: torch.device | str | None, group: Any) -> torch.device:
        if device is not None:
            return torch.device(device)
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _host_buffer(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Host memory for offloaded state: pinned through the project's pinning API (``pin_empty``, no
        pageable temporary) and remembered so that :meth:`destroy` can unpin it."""
        if not pinned:
            return torch.empty(numel, dtype=dtype)
        t = pin_empty(numel, dtype=dtype)
        self._pinned.append(t)
        return t

    def _param_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.param_device.type == "cpu":
            return self._host_buffer(numel, dtype, pinned=self.config.offload_param == "cpu")
        return torch.empty(numel, dtype=dtype, device=self.param_device)

    def _build_buffers(self, trainable: list, frozen: list) -> None:
        cfg = self.config
        P, total = self.layout.partition_size, self.layout.total
        lo, hi = self.rank * P, (self.rank + 1) * P
        model_dtype = cfg.model_dtype
        # R1: every rank starts from rank 0's parameters (the same model built from the same seed already is).
        flat = torch.zeros(total, dtype=model_dtype, device=self.device)
        for n, p in trainable:
            s = self._segments[n]
            flat[s.offset : s.end].copy_(p.detach().reshape(-1))
        fflat = torch.zeros(self.frozen_layout.total, dtype=model_dtype, device=self.device)
        for n, p in frozen:
            s = self._frozen_segments[n]
            fflat[s.offset : s.end].copy_(p.detach().reshape(-1))
        self._comm.broadcast_pieces([(0, flat), (0, fflat)], "initial parameter broadcast")

        # R11/R12: fp32 master, whole at stage 0, one partition from stage 1; host + pinned when offloaded.
        mnumel = total if self.stage == 0 else P
        src = flat if self.stage == 0 else flat[lo:hi]
        if self.master_device.type == "cpu":
            self._master = self._host_buffer(mnumel, torch.float32, pinned=cfg.masters_on_host)
        else:
            self._master = torch.empty(mnumel, dtype=torch.float32, device=self.master_device)
        self._master.copy_(src)
        opt = cfg.optimizer
        names = (
            ("exp_avg", "exp_avg_sq") if opt.type != "sgd" else (("momentum_buffer",) if opt.momentum > 0 else ())
        )
        buffers = {}
        if cfg.offload_optimizer == "nvme":
            # R17 (nvme): the state exists only in its files until the first boundary swaps it in.
            self._swap = StateSwapper(cfg.nvme_path, cfg.nvme_swap, self.rank, names, mnumel)
            self._swap.write_initial()
            names = ()
        for name in names:
            if self.master_device.type == "cpu":
                b = self._host_buffer(mnumel, torch.float32, pinned=cfg.offload_optimizer == "cpu")
            else:
                b = torch.empty(mnumel, dtype=torch.float32, device=self.master_device)
            buffers[name] = b.zero_()
        self._opt_state = OptimizerState(0, buffers)
        #: Stages 2/3 with cpu offload and the native Adam stream the update per bucket (streamed_update.py):
        #: the fp32 gradient accumulator lives on the host, no partition-sized gradient or weight copy on the
        #: device.
        self._update: StreamedUpdate | None = None
        streamed = self.stage >= 2 and cfg.offload_optimizer == "cpu" and uses_native(cfg.optimizer, self._master)
        #: R27 (opt-in): the parameters lag the master by one boundary; built on the streamed update.
        self._delayed = cfg.delayed_parameter_update
        if self._delayed and not streamed:
            raise ConfigurationError(
                "delayed_parameter_update=True needs the native CPU Adam (optimized.cpu_adam), which this build "
                "does not have; allowed: delayed_parameter_update=False, or a build with the native extension"
            )
        # Device -> host gradient staging for the offloaded step (not needed when everything is on the host).
        self._grad_host: torch.Tensor | None = None
        if self.master_device.type == "cpu" and self.device.type != "cpu" and not streamed:
            self._grad_host = self._host_buffer(mnumel, torch.float32, pinned=True)

        # Parameters (R12): stages 0-2 keep the full model-dtype parameters as views of one flat buffer, so the
        # all-gather of the boundary writes them in place; stage 3 keeps only this rank's partitions.
        self._flat_params: torch.Tensor | None = None
        self._param_part: torch.Tensor | None = None
        self._frozen_part: torch.Tensor | None = None
        if self.stage < 3:
            self._flat_params = flat
            for n, p in trainable:
                s = self._segments[n]
                p.data = flat[s.offset : s.end].view(s.shape)
            for n, p in frozen:
                s = self._frozen_segments[n]
                p.data = fflat[s.offset : s.end].view(s.shape).clone()
        else:
            frozen_partition_size = self.frozen_layout.partition_size
            self._param_part = self._param_buffer(P, model_dtype)
            self._param_part.copy_(flat[lo:hi])
            self._frozen_part = self._param_buffer(frozen_partition_size, model_dtype)
            self._frozen_part.copy_(fflat[self.rank * frozen_partition_size : (self.rank + 1) * frozen_partition_size])
        del flat, fflat

        # Where the cast master goes (R13 step 5), and whether the native kernel can write it directly.
        self._cast_master: torch.Tensor | None = None
        if model_dtype == torch.bfloat16 and uses_native(cfg.optimizer, self._master):
            if self._delayed:
                # R27: the live parameters hold the previous boundary's weights, so the kernel's output is a
                # buffer of its own; it starts as the cast of the master (no update pending).
                self._cast_master = self._host_buffer(mnumel, model_dtype, pinned=self.device.type != "cpu")
                self._cast_master.copy_(self._master)
            elif self.stage == 0 and self.device.type == "cpu":
                self._cast_master = self._flat_params
            elif self.stage == 3 and self.param_device.type == "cpu":
                self._cast_master = self._param_part
            elif self.stage == 2 and self.device.type == "cpu" and streamed:
                self._cast_master = self._flat_params[lo:hi]
            else:
                self._cast_master = self._host_buffer(mnumel, model_dtype, pinned=self.device.type != "cpu")
        #: Device copy of this rank's cast partition, the all-gather's input (stages 1/2, not streamed).
        self._gather_source: torch.Tensor | None = None
        if self.stage in (1, 2) and not streamed:
            self._gather_source = torch.empty(P, dtype=model_dtype, device=self.device)

        # Gradient state (R9/R10).
        if self.stage <= 1:
            self._grad_accumulator = torch.zeros(total, dtype=cfg.accum_dtype, device=self.device)
        else:
            if streamed:
                self._grad_accumulator = self._host_buffer(P, cfg.accum_dtype, pinned=self.device.type != "cpu")
                self._grad_accumulator.zero_()
            else:
                self._grad_accumulator = torch.zeros(P, dtype=cfg.accum_dtype, device=self.device)
            #: the flat communication-dtype gradient of one backward (not streamed; streamed: per bucket)
            self._comm_grads = (
                None if streamed else torch.zeros(total, dtype=cfg.comm_dtype, device=self.device)
            )
            self._buckets = self._plan_buckets()
            self._bucket_of = {n: b for b in self._buckets for n in b.names}
            self._got_grad: set[str] = set()
            #: Buckets whose reduce-scatter was launched and whose result is not yet accumulated (streamed).
            self._launched: deque[_Bucket] = deque()
            self._want_norm_pieces = False
        if streamed:
            ranges = []
            for b in self._buckets:
                mine = owners(self.layout, b.start, b.end)[self.rank]
                ranges.append((mine.start - lo, mine.end - lo) if mine.length else (0, 0))
            weights = self._flat_params[lo:hi] if self.stage == 2 else self._param_part
            self._update = StreamedUpdate(
                device=self.device,
                layout=self.layout,
                rank=self.rank,
                ranges=ranges,
                accum_dtype=cfg.accum_dtype,
                accumulator=self._grad_accumulator,
                master=self._master,
                exp_avg=self._opt_state.buffers["exp_avg"],
                exp_avg_sq=self._opt_state.buffers["exp_avg_sq"],
                cast_out=self._cast_master,
                weights=weights,
                # R27: the next backward fills this one while the worker's update reads the other
                delayed_accumulator=(
                    self._host_buffer(P, cfg.accum_dtype, pinned=self.device.type != "cpu").zero_()
                    if self._delayed else None
                ),
            )
            if self.stage == 2:
                self._install_update_waits(lo, hi)
        for n in self.trainable_names:
            self._hooks.append(self._params[n].register_post_accumulate_grad_hook(self._make_grad_hook(n)))
        if self.stage == 3:
            self._units: dict[int, _Unit] = {}
            self._order: list[int] = []
            self._order_done = False
            self._install_stage3_hooks()
            self._release_all()

    def _plan_buckets(self) -> list[_Bucket]:
        """Group parameters in reverse flat order (roughly the order backward produces gradients) into
        buckets of about ``bucket_elements``; the buckets tile the flat buffer so padding travels too."""
        groups: list[list[str]] = []
        current: list[str] = []
        size = 0
        for seg in reversed(self.layout.segments):
            current.append(seg.name)
            size += seg.numel
            if size >= self._bucket_elements:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        groups.sort(key=lambda g: min(self._segments[n].offset for n in g))
        starts = [0] + [min(self._segments[n].offset for n in g) for g in groups[1:]]
        ends = [*starts[1:], self.layout.total]
        buckets = []
        for g, a, b in zip(groups, starts, ends, strict=True):
            splits = [o.length for o in owners(self.layout, a, b)]
            buckets.append(_Bucket(a, b, tuple(g), splits, index=len(buckets)))
        return buckets

    # ---- public surface ------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (call it, or the engine, for the forward)."""
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
        if self._swap is not None:
            self._swap.release()  # the last step's state writes ran during this micro-step's forward
        if self._update is not None:
            if self._delayed:
                # R27: only the published weights matter here; the update itself runs on through this backward.
                self._update.wait_published()
            else:
                self.synchronize()  # the last update's tail ran during this micro-step's forward
            managed = self.config.managed_gradient_accumulation
            # The R14 piece sums are taken on the device as buckets stream out when this backward is (predicted to
            # be) the boundary's; otherwise step() sums the host accumulator.
            predicted = managed and self.is_gradient_accumulation_boundary()
            self._want_norm_pieces = predicted or (not managed and self.device.type != "cpu")
            self._update.begin_backward()
            self._launched.clear()
        if self.stage >= 2:
            self._got_grad.clear()
            for b in self._buckets:
                b.pending = len(b.names)
                b.reduce = None
                b.keep_alive = None
                b.grads = None
        self._in_backward = True
        finished = False
        try:
            # R5: the same division a user writes as ``loss / gas``, in the loss dtype.
            (loss / self.config.gradient_accumulation_steps if scale_wrt_gas else loss).backward()
            if self.stage >= 2:
                self._finish_reductions()
            finished = True
        finally:
            self._in_backward = False
            for p in self._params.values():
                p.grad = None
            if self.stage == 3:
                self._release_all()
            if not finished and self.stage >= 2:
                for b in self._buckets:  # abandoned: the failing rank does not wait on its peers
                    b.grads = None
                    b.reduce = None
                    b.keep_alive = None
        self._grads_pending = True
        self._schedule.backward_done()

    def step(self) -> StepOutcome:
        """R2-R4 / R6 and, at a boundary, the epilogue R13 with the hyper-parameters of ``optimizer``'s group;
        then an attached ``lr_scheduler`` steps (boundaries only, as DeepSpeed steps it)."""
        self._check_alive()
        if not self._delayed:
            # (R27: a boundary waits for the previous update in the epilogue; a non-boundary step reads nothing)
            self.synchronize()
        with self._schedule.step() as boundary:
            outcome = self._boundary_epilogue() if boundary else StepOutcome(boundary=False)
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
        if self._update is not None:
            self._update.reset()
        self._grad_accumulator.zero_()
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
        return ckpt.save(self, save_dir, tag, client_state, save_latest)

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
            self, load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
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
        master = self._master.clone()
        lo = 0 if self.stage == 0 else self.rank * self.layout.partition_size
        hi = lo + master.numel()
        for name, _, local, length in ckpt.pieces_of_range(self.layout.segments, lo, hi):
            if name in state_dict:
                flat = state_dict[name].detach().reshape(-1).to(torch.float32)
                seg = self._segments[name]
                master[local : local + length].copy_(flat[lo + local - seg.offset : lo + local - seg.offset + length])
        frozen = {k: state_dict[k] for k in self.frozen_names if k in state_dict}
        ckpt.install_state(self, master, None, frozen, {k: v for k, v in state_dict.items() if k in buffers})

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter at full shape in the model dtype (stage 3: a collective, all ranks call)."""
        self._check_alive()
        self.synchronize()
        if self.stage < 3:
            return {n: p.detach().clone() for n, p in self._params.items()}
        out = dict(unflatten(self.layout, self._gather_all(self.layout, self._param_part)))
        out.update(unflatten(self.frozen_layout, self._gather_all(self.frozen_layout, self._frozen_part)))
        return {n: out[n].clone() for n in self.parameter_names}

    def master_partition(self) -> torch.Tensor:
        """This rank's fp32 master (whole at stage 0), a copy."""
        self._check_alive()
        self.synchronize()
        return self._master.clone()

    def optimizer_state(self) -> OptimizerState:
        """A copy of this rank's optimizer state (with ``nvme`` offload: read back from its files)."""
        self._check_alive()
        self.synchronize()
        if self._swap is None:
            return OptimizerState(self._opt_state.step, {k: v.clone() for k, v in self._opt_state.buffers.items()})
        self._swap.begin_swap_in()
        try:
            buffers = {k: v.clone() for k, v in self._swap.finish_swap_in().items()}
        finally:
            self._swap.release()
        return OptimizerState(self._opt_state.step, buffers)

    def pinned_buffers(self) -> tuple[torch.Tensor, ...]:
        """The pinned host buffers this engine holds now (offload state, and ``nvme`` state buffers while they
        are in memory), for inspection."""
        return tuple(self._pinned) + (self._swap.resident if self._swap is not None else ())

    @property
    def swap_directory(self) -> str | None:
        """The directory this rank swaps optimizer state into (``nvme`` offload), else None."""
        return None if self._swap is None else self._swap.directory

    def swap_stats(self):
        """The swap handle's :class:`~reference.io.SwapStats` (``nvme`` offload), else None."""
        return None if self._swap is None else self._swap.stats()

    def destroy(self) -> None:
        """Remove every hook, unpin every pinned buffer the engine allocated, close the ``nvme`` swap handle and
        delete its files, and drop all state. Never communicates, so it is safe after another rank failed. The
        engine cannot be used afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self.__dict__.get("_owned_modules", ()):
            ref = _OWNERS.get(m)
            if ref is not None and ref() is self:
                del _OWNERS[m]
        if self.stage == 3 and "_module" in self.__dict__:
            _RELEASED.add(self._module)
        update, self._update = self.__dict__.get("_update"), None
        if update is not None:
            update.close()  # never raises: lets the worker finish (it writes into buffers unpinned below)
        swap, self._swap = self.__dict__.get("_swap"), None
        if swap is not None:
            swap.close()  # never raises: finishes the requests, closes the handle, deletes the files, unpins
        pinned, self._pinned = self._pinned, []
        for attr in (
            "_master", "_opt_state", "_grad_host", "_flat_params", "_param_part", "_frozen_part", "_cast_master",
            "_gather_source", "_grad_accumulator", "_comm_grads", "_buckets", "_bucket_of", "_units",
        ):
            self.__dict__.pop(attr, None)
        for t in pinned:
            unpin(t)
        del pinned
        self._destroyed = True

    # ---- gradients -----------------------------------------------------------------------------------------
    def _make_grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        seg = self._segments[name]

        def hook(p: torch.Tensor) -> None:
            if not self._in_backward or p.grad is None:
                return  # a backward not driven by engine.backward(): leave p.grad to the caller
            g = p.grad.reshape(-1)
            if self.stage <= 1:
                # R9: acc = acc + g.to(accum_dtype), per backward, locally.
                self._grad_accumulator[seg.offset : seg.end].add_(g.to(self.config.accum_dtype))
            else:
                # R10: this backward's gradient in the communication dtype, reduced per bucket.
                bucket = self._bucket_of[name]
                self._bucket_grads(bucket)[seg.offset - bucket.start : seg.end - bucket.start].copy_(g)
                self._got_grad.add(name)
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(bucket)
                    if self._update is not None:
                        # Accumulate and stream out the bucket launched before this one while this one's
                        # reduce-scatter runs (one behind, so the hook does not wait on its own collective).
                        self._launched.append(bucket)
                        while len(self._launched) > 1:
                            self._absorb(self._launched.popleft())
            p.grad = None

        return hook

    def _bucket_grads(self, bucket: _Bucket) -> torch.Tensor:
        """Where this backward's gradients of ``bucket`` go (R10, comm dtype; padding zero)."""
        if self._comm_grads is not None:
            return self._comm_grads[bucket.start : bucket.end]
        if bucket.grads is None:
            bucket.grads = torch.zeros(bucket.end - bucket.start, dtype=self.config.comm_dtype, device=self.device)
        return bucket.grads

    def _launch(self, bucket: _Bucket) -> None:
        contribution = torch.div(self._bucket_grads(bucket), self.world_size)
        bucket.keep_alive = contribution
        bucket.grads = None
        bucket.reduce = self._comm.start_reduce_scatter(contribution, bucket.splits, "bucket reduce-scatter")

    def _finish_reductions(self) -> None:
        """End of a stage-2/3 backward: launch the buckets whose parameters got no gradient (R7: zeros), wait
        for every bucket and add this rank's reduced slice into its partition accumulator (R10)."""
        for b in self._buckets:
            if b.pending:  # not launched by the hooks: some parameter got no gradient
                for n in b.names:
                    if n not in self._got_grad:
                        s = self._segments[n]
                        self._bucket_grads(b)[s.offset - b.start : s.end - b.start].zero_()
                self._launch(b)
                if self._update is not None:
                    self._launched.append(b)
        if self._update is not None:
            while self._launched:
                self._absorb(self._launched.popleft())
            self._update.end_backward(self._want_norm_pieces)
            return
        P = self.layout.partition_size
        base = self.rank * P
        accum = self.config.accum_dtype
        for b in self._buckets:
            mine = owners(self.layout, b.start, b.end)[self.rank]
            reduced = b.reduce.result()
            if mine.length:
                dst = self._grad_accumulator[mine.start - base : mine.end - base]
                dst.add_(reduced.to(accum))
            b.reduce = None
            b.keep_alive = None

    def _absorb(self, bucket: _Bucket) -> None:
        """R10 for one bucket on the streamed path: its reduced slice into the host accumulator."""
        reduced = bucket.reduce.result()
        self._update.absorb(bucket.index, reduced, self._want_norm_pieces)
        bucket.reduce = None
        bucket.keep_alive = None

    def _streamed_epilogue(self) -> StepOutcome:
        """R13 on the streamed path (streamed_update.py): the reduction finished in backward; the norm from the
        per-piece sums; the update runs per bucket on the worker and this returns while it does (stages 1/2 at
        W > 1: after the per-bucket all-gather, which overlaps the update of the next bucket)."""
        cfg = self.config
        comm = self._comm
        update = self._update
        gradients = None
        if self.record_gradients:
            part = update.grad_for_boundary().to(self.device)
            full = torch.empty(self.layout.total, dtype=cfg.accum_dtype, device=self.device)
            comm.all_gather_into(full, part, "gradient record all-gather")
            gradients = {n: t.clone() for n, t in unflatten(self.layout, full.to(torch.float32)).items()}
        # R14: per-piece fp64 sums in flat order (taken on the device as the buckets streamed out), rank order.
        local = 0.0
        for v in update.piece_sums():
            local += v
        norm = math.sqrt(comm.sum_floats_in_rank_order(local, self.device, "gradient norm all-gather"))
        clip_coef: float | None = None
        if cfg.gradient_clipping > 0:
            coef = cfg.gradient_clipping / (norm + CLIP_EPSILON)
            if coef < 1.0:
                clip_coef = coef
        self._opt_state.step += 1
        update.start(self.optimizer.current(), self._opt_state.step, clip_coef)
        if self.stage == 2 and self.world_size > 1:
            # R12 (stage 2): every rank needs every bucket's new weights; broadcast each owner's slice as soon as
            # its bucket is updated, while the worker updates the next one.
            works = []
            for b in self._buckets:
                update.wait_bucket(b.index)
                pieces = [(o.rank, self._flat_params[o.start : o.end]) for o in owners(self.layout, b.start, b.end)]
                works.extend(comm.start_broadcasts(pieces, "parameter all-gather (per bucket)"))
            comm.wait_all(works, "parameter all-gather (per bucket)")
            if self._delayed:
                update.wait_published()
            else:
                update.wait_all()
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=gradients)

    def _boundary_epilogue(self) -> StepOutcome:
        """R13: finish reduction; norm; clip; optimizer; cast back and all-gather; clear gradient state."""
        if self._update is not None:
            return self._streamed_epilogue()
        cfg = self.config
        W, P = self.world_size, self.layout.partition_size
        comm = self._comm
        if self._swap is not None:
            # R17 (nvme): start reading the optimizer state now; the reduction and the norm overlap the reads.
            self._swap.begin_swap_in()
        # 1. Finish the reduction: this rank's partition of the reduced gradient, accumulation dtype.
        if self.stage <= 1:
            contribution = torch.div(self._grad_accumulator.to(cfg.comm_dtype), W)
            part = comm.start_reduce_scatter(contribution, [P] * W, "boundary reduce-scatter").result()
            part = part.to(cfg.accum_dtype)
            if self.stage == 0:
                owned = torch.empty(self.layout.total, dtype=cfg.accum_dtype, device=self.device)
                comm.all_gather_into(owned, part, "boundary all-gather of gradients")
            else:
                owned = part
        else:
            part = owned = self._grad_accumulator
        gradients = None
        if self.record_gradients:
            if self.stage == 0:
                full = owned
            else:
                full = torch.empty(self.layout.total, dtype=cfg.accum_dtype, device=self.device)
                comm.all_gather_into(full, part, "gradient record all-gather")
            gradients = {n: t.clone() for n, t in unflatten(self.layout, full.to(torch.float32)).items()}
        # 2. Global norm (R14): fp64 per piece of this rank's partition, in flat order, then rank order.
        sums = []
        for piece in self.layout.pieces(self.rank):
            seg = part[piece.local_start : piece.local_start + piece.length].to(torch.float64)
            sums.append(torch.sum(torch.mul(seg, seg)))
        local = 0.0
        if sums:
            for v in torch.stack(sums).cpu().tolist():
                local += v
        norm = math.sqrt(comm.sum_floats_in_rank_order(local, self.device, "gradient norm all-gather"))
        # 3. Clipping coefficient (R15); the multiplication happens with the optimizer.
        clip_coef: float | None = None
        if cfg.gradient_clipping > 0:
            coef = cfg.gradient_clipping / (norm + CLIP_EPSILON)
            if coef < 1.0:
                clip_coef = coef
        # 4. Optimizer on the fp32 master (R16), on the host when offloaded (R17).
        g32 = owned.to(torch.float32)
        if self._grad_host is not None:
            self._grad_host.copy_(g32, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            g32 = self._grad_host
        elif g32.device != self._master.device:
            g32 = g32.to(self._master.device)
        if self._swap is not None:
            self._opt_state.buffers = self._swap.finish_swap_in()
        wrote_lp = step_master(
            self.optimizer.current(), self._master, g32, self._opt_state, clip_coef=clip_coef,
            bf16_out=self._cast_master,
        )
        if self._swap is not None:
            # The writes run while the weights are cast and all-gathered; the next backward() waits for them.
            self._opt_state.buffers = {}
            self._swap.begin_swap_out()
        # 5. Cast back to the model dtype and all-gather (R12).
        lp = self._cast_master if wrote_lp else self._master.to(cfg.model_dtype)
        if self.stage == 0:
            if lp is not self._flat_params:
                self._flat_params.copy_(lp, non_blocking=True)
        elif self.stage in (1, 2):
            self._gather_source.copy_(lp, non_blocking=True)
            comm.all_gather_into(self._flat_params, self._gather_source, "parameter all-gather")
        elif lp is not self._param_part:
            self._param_part.copy_(lp, non_blocking=True)
        # 6. Clear the gradient state.
        self._grad_accumulator.zero_()
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=gradients)

    # ---- stage 3 parameter lifecycle (R12, R21) ------------------------------------------------------------
    def _gather_all(self, layout: FlatLayout, part: torch.Tensor) -> torch.Tensor:
        full = torch.empty(layout.total, dtype=self.config.model_dtype, device=self.device)
        self._comm.all_gather_into(full, part.to(self.device), "full parameter all-gather")
        return full

    def _install_stage3_hooks(self) -> None:
        names_of = {id(p): n for n, p in self._params.items()}
        for mod in self._module.modules():
            direct = [names_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in names_of]
            if not direct:
                continue
            unit = _Unit(
                tuple(n for n in direct if n in self._segments), tuple(n for n in direct if n in self._frozen_segments)
            )
            self._units[id(mod)] = unit
            self._hooks.append(mod.register_forward_pre_hook(self._make_pre_forward(id(mod))))
            self._hooks.append(mod.register_forward_hook(self._make_post_forward(id(mod))))

    def _range_of(self, names: tuple[str, ...], segs: dict) -> tuple[int, int]:
        return min(segs[n].offset for n in names), max(segs[n].end for n in names)

    def _start_gather(self, unit: _Unit) -> list[Any]:
        """Post the broadcasts that assemble ``unit``'s parameters; returns what :meth:`_install` needs."""
        plans = []
        pieces = []
        for names, layout, segs, part in (
            (unit.trainable, self.layout, self._segments, self._param_part),
            (unit.frozen, self.frozen_layout, self._frozen_segments, self._frozen_part),
        ):
            if not names:
                continue
            a, b = self._range_of(names, segs)
            update = self._update
            if update is not None and update.in_flight and part is self._param_part:
                # Streamed update (stage 3): wait for this rank's buckets of the unit only.
                base = self.rank * layout.partition_size
                update.wait_range(max(a, base) - base, min(b, base + layout.partition_size) - base)
            if self.world_size == 1 and part.device == self.device:
                # One rank owns everything and it is already on the device: view it, copy nothing.
                plans.append((names, segs, a, part[a:b]))
                continue
            buf = torch.empty(b - a, dtype=self.config.model_dtype, device=self.device)
            P = layout.partition_size
            for o in owners(layout, a, b):
                if not o.length:
                    continue
                view = buf[o.start - a : o.end - a]
                if o.rank == self.rank:
                    view.copy_(part[o.start - self.rank * P : o.end - self.rank * P], non_blocking=True)
                pieces.append((o.rank, view))
            plans.append((names, segs, a, buf))
        return [plans, pieces]

    def _install(self, unit: _Unit, plan: list[Any], works: list[Any] | None = None) -> None:
        plans, pieces = plan
        if works is None:
            self._comm.broadcast_pieces(pieces, "stage-3 parameter gather")
        else:
            self._comm.wait_all(works, "stage-3 parameter prefetch")
        for names, segs, a, buf in plans:
            for n in names:
                s = segs[n]
                self._params[n].data = buf[s.offset - a : s.end - a].view(s.shape)
        unit.gathered = True

    def _gather(self, key: int) -> None:
        unit = self._units[key]
        if unit.gathered:
            return
        if unit.prefetched:
            plan, works = unit.prefetched
            unit.prefetched = []
            self._install(unit, plan, works)
            self.prefetch_hits += 1
            return
        self._install(unit, self._start_gather(unit))

    def _release(self, key: int) -> None:
        unit = self._units[key]
        if unit.prefetched:  # prefetched but never used: complete the broadcasts every rank posted
            works = unit.prefetched[1]
            unit.prefetched = []
            self._comm.wait_all(works, "stage-3 parameter prefetch")
        for n in (*unit.trainable, *unit.frozen):
            p = self._params[n]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        unit.gathered = False

    def _release_all(self) -> None:
        for key in self._units:
            self._release(key)
        if self._order:
            self._order_done = True

    def _make_pre_forward(self, key: int) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            # R21: every parameter of the module, frozen or not, is gathered before its forward runs,
            # including the forward that activation checkpointing replays during backward.
            self._gather(key)
            if not self._in_backward:
                if not self._order_done:
                    self._order.append(key)
                elif self.prefetch:
                    self._prefetch_next(key, 1)

        return pre_forward

    def _prefetch_next(self, key: int, direction: int) -> None:
        """Post the gather of the module that ran just after (``direction=1``, forward) or just before
        (``direction=-1``, backward) ``key`` in the first forward, so it is ready when it runs. Every rank posts
        the same broadcasts in the same order (the recorded order is the same everywhere)."""
        try:
            pos = self._order.index(key) + direction
        except ValueError:
            return
        if not 0 <= pos < len(self._order):
            return
        unit = self._units[self._order[pos]]
        if not unit.gathered and not unit.prefetched:
            plan = self._start_gather(unit)
            unit.prefetched = [plan, self._comm.start_broadcasts(plan[1], "stage-3 parameter prefetch")]

    def _make_post_forward(self, key: int) -> Callable[..., None]:
        def regather(grad: torch.Tensor) -> None:
            self._gather(key)
            if self.prefetch and self._order_done:
                # Backward visits modules roughly in reverse forward order: fetch the one before this now.
                self._prefetch_next(key, -1)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward:
                # A checkpoint recompute: its backward nodes still need the parameters until backward() ends.
                return
            self._release(key)
            # The module's backward reads the parameters it saved; gather them again as soon as the gradient
            # reaches its output, i.e. before any of its backward nodes run.
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(regather)

        return post_forward

    def synchronize(self) -> None:
        """Wait until the last boundary's update is complete and visible to the current stream.

        With ``offload_optimizer: cpu`` at stages 2/3 (world size 1, or stage 3) ``step()`` returns while the
        CPU Adam of later buckets still runs and their weights are still being copied to the device; each
        module's forward waits for its own parameters, and every engine method that reads weights or optimizer
        state calls this first. Call it yourself before reading a parameter tensor some other way (a reference
        to ``p.data`` kept from before ``step()``, a hook of your own) between ``step()`` and the next forward.
        A no-op when nothing is in flight; re-raises an error of the update."""
        update = self.__dict__.get("_update")
        if update is not None and update.in_flight:
            update.wait_all()

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
        if self._delayed:
            if self.device.type == "cuda":
                # Host partitions (offload_param) may still be read by a gather's H2D queued before this call.
                torch.cuda.current_stream(self.device).synchronize()
            source = self._master if self._cast_master is None else self._cast_master
            self._write_live(source, "apply_delayed_update parameter all-gather")

    def _live_partition(self) -> torch.Tensor:
        """This rank's range of the parameters the module computes with (stages 2/3), model dtype."""
        P = self.layout.partition_size
        return self._flat_params[self.rank * P : (self.rank + 1) * P] if self.stage < 3 else self._param_part

    def _write_live(self, lp: torch.Tensor, what: str = "parameter all-gather") -> None:
        """``lp`` (this rank's model-dtype partition) becomes the parameters (R13 step 5): all-gathered at stages
        1/2, stored as the partition at stage 3, the whole buffer at stage 0."""
        if self.stage == 0:
            self._flat_params.copy_(lp)
        elif self.stage in (1, 2):
            source = lp.to(self.device) if self._gather_source is None else self._gather_source.copy_(lp)
            self._comm.all_gather_into(self._flat_params, source, what)
        else:
            self._param_part.copy_(lp)

    def offload_timings(self) -> dict[str, float] | None:
        """Where the streamed offloaded update spent its time since the last call (seconds: ``cpu_adam_s``,
        ``wait_s`` -- the training thread blocked on it --, ``d2h_s``, ``h2d_s``), or None when the update is
        not streamed (no cpu offload, stage 0/1, SGD). Synchronizes; meant for benchmarks."""
        update = self.__dict__.get("_update")
        return None if update is None else update.take_timings()

    def _install_update_waits(self, lo: int, hi: int) -> None:
        """Stage 2, streamed: before each module's forward, wait for the buckets holding its own parameters
        only (``[lo, hi)`` is this rank's partition; other ranks' slices arrive in step())."""
        names_of = {id(p): n for n, p in self._params.items() if n in self._segments}
        for mod in self._module.modules():
            segs = [self._segments[names_of[id(p)]] for p in mod.parameters(recurse=False) if id(p) in names_of]
            a = max(lo, min((s.offset for s in segs), default=hi))
            b = min(hi, max((s.end for s in segs), default=lo))
            if a >= b:
                continue

            def wait_own(module: nn.Module, args: Any, a: int = a - lo, b: int = b - lo) -> None:
                update = self._update
                if update is not None and update.in_flight:
                    update.wait_range(a, b)

            self._hooks.append(mod.register_forward_pre_hook(wait_own))

    def _check_alive(self) -> None:
        if self._destroyed:
            raise UnsupportedOperationError("the engine was destroyed; allowed: build a new ZeroEngine")

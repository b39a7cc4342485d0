"""The typed, validated configuration of a ZeRO gradient-accumulation engine.

Keys follow the names DeepSpeed users already write (``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``gradient_clipping`` ...), flattened into one level so that a config is a
plain mapping that survives pickling to worker processes. Every value is checked when the object is built, so
an engine never starts with a config that would fail half-way through a run: the rules that forbid option
*combinations* (docs/accumulation.md, R19) live here too, next to the single-option checks.

Contract: both engines take exactly this object and reject the same configurations with the same errors (R19),
so a config written for one runs unchanged on the other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from reference.contract.accumulation_state_precision import (
    DEFAULT_STATE_PRECISION,
    StatePrecision,
    resolve_state_precision,
    state_dtype,
)
from reference.contract.deepspeed_config import deepspeed_to_flat, is_deepspeed_shaped
from reference.contract.errors import ConfigurationError, allowed_values_error
from reference.contract.io_config import SwapConfig
from reference.contract.lr_schedule_config import SchedulerConfig

#: Model / communication / accumulation dtypes the model describes (fp16 needs loss scaling: out of scope).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
#: Where ``offload_param`` may keep stage-3 parameter partitions.
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")
#: Where ``offload_optimizer`` may keep the optimizer state: ``nvme`` keeps the masters on the host like ``cpu``
#: and swaps the optimizer state to files under ``nvme_path`` between steps (R17).
OFFLOAD_OPTIMIZER_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
#: The ``gpu_share`` (R28) that asks the engine to choose the share from a measurement.
GPU_SHARE_AUTO = "auto"


class _Unset:
    """The default of ``gpu_share`` before it is resolved: 0.0, or "auto" where ``gpu_memory_limit`` is set (a
    share the user wrote beside a limit is refused, one left out is not)."""

    def __repr__(self) -> str:
        return "<unset>"


_SHARE_UNSET: Any = _Unset()
#: R27: undelayed boundaries before the one-step delay starts, by default (docs/accumulation.md says why 100).
DEFAULT_DELAYED_UPDATE_WARMUP = 100
#: R30: when the host optimizer step of a boundary starts: in ``step()`` once the global norm is known (the
#: default), or per bucket during the boundary's last backward, speculatively unclipped and redone from the
#: untouched state where the norm then clips.
HOST_UPDATE_STARTS: tuple[str, ...] = ("step", "last_backward")


def _require_bool(name: str, value: object) -> None:
    if type(value) is not bool:
        raise ConfigurationError(f"{name}={value!r} must be a bool; allowed values: True, False")


def _require_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ConfigurationError(f"{name}={value!r} must be an int >= {minimum}")


def _require_float(name: str, value: object, low: float, high: float, *, low_open: bool, high_open: bool) -> None:
    ok = (
        isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value)
        and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    )
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ConfigurationError(f"{name}={value!r} must be a finite number in {lo}{low}, {high}{hi}")


def _reject_unknown_keys(where: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigurationError(
            f"unknown {where} key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(allowed)}"
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer choice and hyper-parameters (formulas: docs/accumulation.md R16,
    reference.accumulation.optimizers).

    ``momentum`` is read by SGD only; ``betas`` and ``eps`` by Adam and AdamW only. They are still validated
    for every optimizer so that a typo never hides behind an optimizer that ignores the field.
    """

    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.type, str) and self.type.lower() in OPTIMIZERS:
            object.__setattr__(self, "type", self.type.lower())  # "Adam", "AdamW", "SGD" as DeepSpeed spells them
        if self.type not in OPTIMIZERS:
            raise allowed_values_error("optimizer.type", self.type, OPTIMIZERS)
        _require_float("optimizer.lr", self.lr, 0.0, math.inf, low_open=False, high_open=True)
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ConfigurationError(f"optimizer.betas={betas!r} must be a pair (beta1, beta2), each in [0, 1)")
        for i, b in enumerate(betas):
            _require_float(f"optimizer.betas[{i}]", b, 0.0, 1.0, low_open=False, high_open=True)
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _require_float("optimizer.eps", self.eps, 0.0, math.inf, low_open=True, high_open=True)
        _require_float("optimizer.weight_decay", self.weight_decay, 0.0, math.inf, low_open=False, high_open=True)
        _require_float("optimizer.momentum", self.momentum, 0.0, 1.0, low_open=False, high_open=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> OptimizerConfig:
        if not isinstance(values, Mapping):
            raise ConfigurationError(f"optimizer={values!r} must be a mapping with keys: {', '.join(_OPT_KEYS)}")
        _reject_unknown_keys("optimizer", values, _OPT_KEYS)
        return cls(**dict(values))


_OPT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(OptimizerConfig))
_SWAP_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SwapConfig))


@dataclass(frozen=True)
class AccumulationConfig:
    """Everything that decides the numbers an accumulation engine produces.

    ``communication_data_type`` and ``grad_accum_dtype`` default to ``None``, meaning "the model dtype" (R11);
    use :attr:`comm_dtype` / :attr:`accum_dtype` for the resolved torch dtypes.

    ``nvme_path`` is the directory ``offload_optimizer: nvme`` swaps optimizer state into (required then, an
    existing directory; each engine makes its own sub-directory there and removes it in ``destroy()``);
    ``nvme_swap`` holds the swap handle's knobs (:class:`reference.io.SwapConfig`, or a mapping of its keys).
    Both are ignored by the other offload modes, which is why a path is kept as a plain ``str``: the config
    must pickle to worker processes on the same machine.
    """

    zero_stage: int = 0
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    managed_gradient_accumulation: bool = True
    dtype: str = "fp32"
    communication_data_type: str | None = None
    grad_accum_dtype: str | None = None
    gradient_clipping: float = 1.0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    nvme_swap: SwapConfig = field(default_factory=SwapConfig)
    overlap_comm: bool = False
    pipeline_parallel_size: int = 1
    train_batch_size: int | None = None
    #: R27: the weights the model computes with lag the fp32 master by one boundary (opt-in; DeepSpeed's DPU).
    delayed_parameter_update: bool = False
    #: R28: the share of each rank's partition whose fp32 master and optimizer state stay on the device and are
    #: updated there (the rest on the host), a number in [0, 1] or "auto" (chosen from a measurement).
    gpu_share: float | str = _SHARE_UNSET
    #: R28: the device bytes "auto" may give the split (None: half the device memory free when it chooses).
    gpu_memory_budget: int | None = None
    #: R28: a limit (bytes) on the engine's whole peak device memory; "auto" gives the split what the measured
    #: floor leaves (docs/accumulation.md R28, ``reference.contract.accumulation_limit``). Implies "auto".
    gpu_memory_limit: int | None = None
    #: R27: the first this many boundaries are not delayed (ignored without ``delayed_parameter_update``).
    delayed_update_warmup: int = DEFAULT_DELAYED_UPDATE_WARMUP
    #: R29: the precision the Adam moments are stored in, "fp32" (default) or "bf16" (case-insensitive).
    state_precision: str = DEFAULT_STATE_PRECISION
    #: R30: "step" (default) or "last_backward" (the streamed host update starts under the boundary's last
    #: backward, speculatively assuming no clipping; same arithmetic as "step").
    host_update_start: str = "step"
    #: DeepSpeed's ``scheduler`` section (:class:`SchedulerConfig`, or its ``{"type", "params"}`` mapping): the
    #: engine builds it on ``engine.optimizer`` and steps it at each boundary. None: no schedule.
    scheduler: SchedulerConfig | None = None
    #: Elements per gradient bucket at stages 2/3 (DeepSpeed's ``reduce_bucket_size``); None: the engine's
    #: ``bucket_elements`` argument, or its default.
    bucket_elements: int | None = None

    def __post_init__(self) -> None:
        if type(self.zero_stage) is not int or self.zero_stage not in ZERO_STAGES:
            raise allowed_values_error("zero_stage", self.zero_stage, ZERO_STAGES)
        _require_int("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu, 1)
        _require_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        _require_bool("managed_gradient_accumulation", self.managed_gradient_accumulation)
        if self.dtype not in DTYPES:
            raise allowed_values_error("dtype", self.dtype, tuple(DTYPES))
        for name in ("communication_data_type", "grad_accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise allowed_values_error(name, value, (None, *DTYPES))
        _require_float("gradient_clipping", self.gradient_clipping, 0.0, math.inf, low_open=False, high_open=True)
        if isinstance(self.optimizer, Mapping):
            object.__setattr__(self, "optimizer", OptimizerConfig.from_dict(self.optimizer))
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigurationError(
                f"optimizer={self.optimizer!r} must be an OptimizerConfig or a mapping with keys: "
                f"{', '.join(_OPT_KEYS)}"
            )
        if self.offload_optimizer not in OFFLOAD_OPTIMIZER_DEVICES:
            raise allowed_values_error("offload_optimizer", self.offload_optimizer, OFFLOAD_OPTIMIZER_DEVICES)
        if self.offload_param not in OFFLOAD_DEVICES:
            raise allowed_values_error("offload_param", self.offload_param, OFFLOAD_DEVICES)
        self._check_nvme()
        _require_bool("overlap_comm", self.overlap_comm)
        _require_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.train_batch_size is not None:
            _require_int("train_batch_size", self.train_batch_size, 1)
        _require_bool("delayed_parameter_update", self.delayed_parameter_update)
        _require_int("delayed_update_warmup", self.delayed_update_warmup, 0)
        self._check_split()
        self._check_state_precision()
        self._check_host_update_start()
        if isinstance(self.scheduler, Mapping):
            object.__setattr__(self, "scheduler", SchedulerConfig.from_dict(self.scheduler))
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigurationError(
                f"scheduler={self.scheduler!r} must be None, a SchedulerConfig or a mapping with keys: type, params"
            )
        if self.bucket_elements is not None:
            _require_int("bucket_elements", self.bucket_elements, 1)
        self._check_combinations()

    def check_world_size(self, world_size: int) -> None:
        """DeepSpeed's batch identity: ``train_batch_size == train_micro_batch_size_per_gpu *
        gradient_accumulation_steps * world_size`` when ``train_batch_size`` is given (engines call this once
        they know W)."""
        if self.train_batch_size is None:
            return
        product = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * world_size
        if product != self.train_batch_size:
            raise ConfigurationError(
                f"train_batch_size={self.train_batch_size} != train_micro_batch_size_per_gpu="
                f"{self.train_micro_batch_size_per_gpu} * gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} * world_size={world_size} (= {product}); allowed: values whose "
                f"product is train_batch_size, or leave one of the three out to have it derived"
            )

    def _check_nvme(self) -> None:
        path = self.nvme_path
        if path is not None:
            if isinstance(path, os.PathLike):
                path = os.fspath(path)
            if not isinstance(path, str) or not path:
                raise ConfigurationError(
                    f"nvme_path={self.nvme_path!r} must be None or a non-empty str / PathLike naming a directory"
                )
            object.__setattr__(self, "nvme_path", path)
        if self.offload_optimizer == "nvme":
            if path is None:
                raise ConfigurationError(
                    "offload_optimizer='nvme' requires nvme_path (an existing directory to swap optimizer state "
                    "into); allowed: set nvme_path, or offload_optimizer 'none' / 'cpu'"
                )
            if not os.path.isdir(path):
                raise ConfigurationError(
                    f"nvme_path={path!r} is not an existing directory; offload_optimizer='nvme' swaps optimizer "
                    f"state into files there (allowed: a directory that exists and is writable)"
                )
        swap = self.nvme_swap
        if isinstance(swap, Mapping):
            _reject_unknown_keys("nvme_swap", swap, _SWAP_KEYS)
            try:
                swap = SwapConfig(**dict(swap))
            except ConfigurationError as exc:
                raise ConfigurationError(f"nvme_swap.{exc}") from exc
            object.__setattr__(self, "nvme_swap", swap)
        if not isinstance(swap, SwapConfig):
            raise ConfigurationError(
                f"nvme_swap={swap!r} must be a reference.io.SwapConfig or a mapping with keys: {', '.join(_SWAP_KEYS)}"
            )

    def _check_combinations(self) -> None:
        # R19: parameter offload only exists where parameters are partitioned.
        if self.offload_param != "none" and self.zero_stage < 3:
            raise ConfigurationError(
                f"offload_param={self.offload_param!r} requires zero_stage=3 "
                f"(got zero_stage={self.zero_stage}); "
                f"allowed values of offload_param at this stage: 'none'"
            )
        if self.delayed_parameter_update:
            self._check_delayed_update()
        if not self.managed_gradient_accumulation:
            # R19: stages 0/1 with overlap_comm reduce from inside backward() as soon as a bucket fills, which
            # presumes the engine knows the boundary at backward time; unmanaged mode only knows it in step().
            if self.overlap_comm and self.zero_stage in (0, 1):
                raise ConfigurationError(
                    f"overlap_comm=True cannot be combined with managed_gradient_accumulation=False on "
                    f"zero_stage={self.zero_stage}; allowed: overlap_comm=False, or zero_stage 2/3, or "
                    f"managed_gradient_accumulation=True"
                )
            # R19: the pipeline schedule owns the micro-batch loop and therefore the boundary.
            if self.pipeline_parallel_size != 1:
                raise ConfigurationError(
                    f"pipeline_parallel_size={self.pipeline_parallel_size} cannot be combined with "
                    f"managed_gradient_accumulation=False; allowed: pipeline_parallel_size=1, or "
                    f"managed_gradient_accumulation=True"
                )

    def _check_split(self) -> None:
        """R19/R28: ``gpu_share`` is "auto" (any case) or a number in [0, 1] (ints 0 and 1 taken as floats);
        anything but 0 needs the streamed host update it splits (``offload_optimizer: cpu``, stage 2 or 3,
        Adam/AdamW, as R27);
        ``gpu_memory_budget`` is None or bytes (an int >= 0) and is read by "auto" only; ``gpu_memory_limit``
        (:meth:`_check_limit`) resolves a share left out to "auto"."""
        self._check_limit()
        share = self.gpu_share
        if isinstance(share, str) and share.lower() == GPU_SHARE_AUTO:
            share = GPU_SHARE_AUTO  # "Auto", "AUTO": spelled like the optimizer type, case-insensitively
            object.__setattr__(self, "gpu_share", share)
        if share != GPU_SHARE_AUTO:
            if not (isinstance(share, (int, float)) and type(share) is not bool and math.isfinite(share)
                    and 0.0 <= share <= 1.0):
                raise ConfigurationError(
                    f"gpu_share={share!r} must be {GPU_SHARE_AUTO!r} or a number in [0, 1]; allowed values: "
                    f"{GPU_SHARE_AUTO!r}, 0.0 (all on the host, the default) ... 1.0 (all on the device)"
                )
            object.__setattr__(self, "gpu_share", float(share))
        budget = self.gpu_memory_budget
        if budget is not None and (type(budget) is not int or budget < 0):
            raise ConfigurationError(
                f"gpu_memory_budget={budget!r} must be None or an int >= 0 (bytes); allowed values: None (half the "
                f"device memory free when 'auto' chooses), 0, 1, 2, ..."
            )
        if budget is not None and self.gpu_share != GPU_SHARE_AUTO:
            raise ConfigurationError(
                f"gpu_memory_budget={budget} is read by gpu_share={GPU_SHARE_AUTO!r} only (got gpu_share="
                f"{self.gpu_share!r}); allowed: gpu_share={GPU_SHARE_AUTO!r}, or leave gpu_memory_budget out"
            )
        if self.gpu_share != 0.0:
            wrong = self._outside_host_update("gpu_share")
            if wrong:
                raise ConfigurationError(
                    f"gpu_share={self.gpu_share!r} splits the streamed host update, which needs "
                    f"offload_optimizer='cpu', zero_stage 2 or 3 and an Adam optimizer; got {', '.join(wrong)}; "
                    f"allowed: change those, or gpu_share=0.0"
                )

    def _check_limit(self) -> None:
        """R19/R28: ``gpu_memory_limit`` is None or bytes (an int > 0), a limit on the engine's whole peak device
        memory that "auto" fits the split into: it implies ``gpu_share: "auto"`` (a share left out becomes "auto",
        a numeric one is refused), replaces ``gpu_memory_budget`` (refused together) and needs the streamed host
        update the split divides."""
        limit, share = self.gpu_memory_limit, self.gpu_share
        if limit is None:
            if share is _SHARE_UNSET:
                object.__setattr__(self, "gpu_share", 0.0)
            return
        if type(limit) is not int or limit <= 0:
            raise ConfigurationError(
                f"gpu_memory_limit={limit!r} must be None or an int > 0 (bytes: the engine's whole peak device "
                f"memory); allowed values: None (no limit), 1, 2, ..."
            )
        if self.gpu_memory_budget is not None:
            raise ConfigurationError(
                f"gpu_memory_limit={limit} and gpu_memory_budget={self.gpu_memory_budget} were both given: the limit "
                f"sets the split's budget itself (what its measured floor leaves); allowed: one or the other"
            )
        if share is _SHARE_UNSET:
            object.__setattr__(self, "gpu_share", GPU_SHARE_AUTO)
        elif not (isinstance(share, str) and share.lower() == GPU_SHARE_AUTO):
            raise ConfigurationError(
                f"gpu_memory_limit={limit} is fitted by gpu_share={GPU_SHARE_AUTO!r}, not by gpu_share={share!r}; "
                f"allowed: leave gpu_share out (or {GPU_SHARE_AUTO!r}) with gpu_memory_limit, or drop the limit"
            )
        wrong = self._outside_host_update("gpu_memory_limit")
        if wrong:
            raise ConfigurationError(
                f"gpu_memory_limit={limit} fits the split of the streamed host update, which needs "
                f"offload_optimizer='cpu', zero_stage 2 or 3 and an Adam optimizer; got {', '.join(wrong)}; "
                f"allowed: change those, or leave gpu_memory_limit out"
            )

    def _check_state_precision(self) -> None:
        """R19/R29: ``state_precision`` names a precision (any case); a compressed one stores Adam's moments, so it
        needs Adam or AdamW, and the state in memory (``offload_optimizer`` 'none' or 'cpu': the ``nvme`` files
        are fp32)."""
        object.__setattr__(self, "state_precision", resolve_state_precision(self.state_precision).name)
        if self.state_precision == DEFAULT_STATE_PRECISION:
            return
        wrong = []
        if self.optimizer.type not in ("adam", "adamw"):
            wrong.append(f"optimizer.type={self.optimizer.type!r} (allowed with it: 'adam', 'adamw')")
        if self.offload_optimizer == "nvme":
            wrong.append("offload_optimizer='nvme' (allowed with it: 'none', 'cpu')")
        if wrong:
            raise ConfigurationError(
                f"state_precision={self.state_precision!r} stores Adam's moments compressed, which needs an Adam "
                f"optimizer and the state in memory; got {', '.join(wrong)}; allowed: change those, or "
                f"state_precision={DEFAULT_STATE_PRECISION!r}"
            )

    def _check_host_update_start(self) -> None:
        """R19/R30: ``host_update_start`` is "step" or "last_backward"; the latter starts the streamed host update
        under the boundary's last backward, so it needs that update (``offload_optimizer: cpu``, stage 2 or 3,
        Adam/AdamW), a boundary known at backward time (``managed_gradient_accumulation``), and not R27's delayed
        update (which already moves the whole update out of the step): refused rather than half-supported. With
        R28's split only the host side starts early; the device side steps in ``step()``."""
        start = self.host_update_start
        if not isinstance(start, str) or start not in HOST_UPDATE_STARTS:
            raise allowed_values_error("host_update_start", start, HOST_UPDATE_STARTS)
        if start == "step":
            return
        wrong = self._outside_host_update("host_update_start='last_backward'")
        if not self.managed_gradient_accumulation:
            wrong.append("managed_gradient_accumulation=False (allowed with it: True)")
        if self.delayed_parameter_update:
            wrong.append("delayed_parameter_update=True (allowed with it: False)")
        if wrong:
            raise ConfigurationError(
                f"host_update_start='last_backward' starts the streamed host update under the boundary's last "
                f"backward, which needs offload_optimizer='cpu', zero_stage 2 or 3, an Adam optimizer, a managed "
                f"schedule and no delayed update; got {', '.join(wrong)}; allowed: change those, or "
                f"host_update_start='step'"
            )

    def _outside_host_update(self, key: str) -> list[str]:
        """The settings that put a config outside the streamed host update (R27, R28), each with its allowed
        values."""
        wrong = []
        if self.offload_optimizer != "cpu":
            wrong.append(f"offload_optimizer={self.offload_optimizer!r} (allowed with {key}: 'cpu')")
        if self.zero_stage not in (2, 3):
            wrong.append(f"zero_stage={self.zero_stage} (allowed with {key}: 2, 3)")
        if self.optimizer.type not in ("adam", "adamw"):
            wrong.append(f"optimizer.type={self.optimizer.type!r} (allowed with {key}: 'adam', 'adamw')")
        return wrong

    def _check_delayed_update(self) -> None:
        """R19/R27: the one-step-delayed update exists to hide the host optimizer step behind the next step's
        forward and backward, so it is defined where that step streams per bucket: the masters and the Adam
        state on the host (``offload_optimizer: cpu``), gradients partitioned (stages 2/3), Adam or AdamW."""
        wrong = self._outside_host_update("delayed_parameter_update")
        if wrong:
            raise ConfigurationError(
                f"delayed_parameter_update=True requires offload_optimizer='cpu', zero_stage 2 or 3 and an Adam "
                f"optimizer; got {', '.join(wrong)}; allowed: change those, or delayed_parameter_update=False"
            )

    # ---- resolved dtypes -----------------------------------------------------------------------------------
    @property
    def model_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def comm_dtype(self) -> torch.dtype:
        return DTYPES[self.communication_data_type or self.dtype]

    @property
    def accum_dtype(self) -> torch.dtype:
        return DTYPES[self.grad_accum_dtype or self.dtype]

    @property
    def moment_precision(self) -> StatePrecision:
        """R29: the resolved precision of the optimizer's moment buffers (dtype and rounding)."""
        return resolve_state_precision(self.state_precision)

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the optimizer-state buffers: :func:`state_dtype` for this optimizer and precision."""
        return state_dtype(self.optimizer.type, self.moment_precision)

    # ---- resolved placement --------------------------------------------------------------------------------
    @property
    def masters_on_host(self) -> bool:
        """R17: the fp32 masters (and the optimizer step) live on the host: ``cpu`` and ``nvme`` offload alike
        (``nvme`` differs only in where the optimizer state waits between steps)."""
        return self.offload_optimizer != "none"

    # ---- mapping round trip --------------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, values: AccumulationConfig | Mapping[str, Any], world_size: int | None = None
    ) -> AccumulationConfig:
        """Build from a flat mapping, or from DeepSpeed's nested shape (see :func:`from_deepspeed`); unknown keys
        are rejected (R19) so a misspelt option never goes unnoticed. With ``world_size`` the batch identity is
        checked (and DeepSpeed-shaped configs may leave one batch key out to have it derived)."""
        cfg: AccumulationConfig
        if isinstance(values, AccumulationConfig):
            cfg = values
        elif not isinstance(values, Mapping):
            raise ConfigurationError(
                f"config={values!r} must be an AccumulationConfig or a mapping with keys: {', '.join(CONFIG_KEYS)}"
            )
        elif is_deepspeed_shaped(values):
            cfg = from_deepspeed(values, world_size)
        else:
            _reject_unknown_keys("config", values, CONFIG_KEYS)
            cfg = cls(**dict(values))
        if world_size is not None:
            cfg.check_world_size(world_size)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["optimizer"] = asdict(self.optimizer)
        out["nvme_swap"] = asdict(self.nvme_swap)
        return out

    def replace(self, **changes: Any) -> AccumulationConfig:
        """A copy with some keys changed, validated again as a whole. Adding a ``gpu_memory_limit`` to a config at
        share 0 (the resolved default) without naming ``gpu_share`` leaves the share out, so the limit's "auto"
        applies."""
        values = self.to_dict()
        _reject_unknown_keys("config", changes, CONFIG_KEYS)
        if changes.get("gpu_memory_limit") is not None and "gpu_share" not in changes and values["gpu_share"] == 0.0:
            del values["gpu_share"]
        values.update(changes)
        return AccumulationConfig.from_dict(values)


def from_deepspeed(values: Mapping[str, Any], world_size: int | None = None) -> AccumulationConfig:
    """DeepSpeed's nested config (:func:`reference.contract.deepspeed_config.deepspeed_to_flat`: every problem of
    its keys refused at once, HF's "auto" resolved where derivable), validated as this config."""
    return AccumulationConfig(**deepspeed_to_flat(values, world_size))


#: Every key :meth:`AccumulationConfig.from_dict` accepts.
CONFIG_KEYS: tuple[str, ...] = tuple(f.name for f in fields(AccumulationConfig))


__all__ = [
    "CONFIG_KEYS",
    "DTYPES",
    "OFFLOAD_DEVICES",
    "OFFLOAD_OPTIMIZER_DEVICES",
    "OPTIMIZERS",
    "ZERO_STAGES",
    "AccumulationConfig",
    "OptimizerConfig",
    "from_deepspeed",
    "is_deepspeed_shaped",
]

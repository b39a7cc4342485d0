"""DeepSpeed's nested config (and HF Trainer's ``"auto"`` values) onto :class:`AccumulationConfig`.

A user ports a DeepSpeed script with its ``ds_config`` unchanged: every key DeepSpeed documents is honoured, mapped
onto this engine's own key, accepted with no effect (where it changes nothing here), or refused -- the decision per
key is in :mod:`reference.contract.deepspeed_keys` and docs/zero.md's mapping table. All the problems of a config
are collected (:class:`~reference.contract.config_problems.ConfigProblems`) and refused in one error, each with what
to write instead, so a config is fixed in one edit rather than one rerun per key.

``"auto"`` is HF's placeholder for a value its Trainer fills from its arguments. Without a Trainer, a value is
resolved here only where the rest of the config determines it: one of the three batch keys from the other two
(and the world size), the optimizer's ``lr`` from the scheduler's peak and the scheduler's ``warmup_max_lr`` from
the optimizer's ``lr`` (HF fills both from one ``learning_rate``), ``warmup_min_lr`` as 0 (HF's constant), and
the performance-only sizes (``reduce_bucket_size``, ``stage3_*``) as this engine's defaults. Every other ``"auto"``
(clipping, betas, step counts, precision flags) depends on arguments the config does not carry: refused by name.

Contract: both implementations translate through this module, so a DeepSpeed config means the same on each. It
imports nothing of the config class: it returns the flat keys, and ``AccumulationConfig.from_dict`` validates them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from reference.contract.config_problems import ConfigProblems
from reference.contract.deepspeed_keys import SECTIONS, KeyRule, is_auto, size_value
from reference.contract.errors import ConfigurationError
from reference.contract.lr_schedule_config import SCHEDULER_TYPES, SchedulerConfig, param_names, required_params

__all__ = ["DEEPSPEED_ONLY_KEYS", "DEEPSPEED_OPTIMIZER_TYPES", "deepspeed_to_flat", "is_deepspeed_shaped"]

#: The optimizer types DeepSpeed's config names that this engine runs (any case).
DEEPSPEED_OPTIMIZER_TYPES: tuple[str, ...] = ("Adam", "AdamW", "SGD")

#: Top-level keys only DeepSpeed's shape has: one of them selects this translation.
DEEPSPEED_ONLY_KEYS: tuple[str, ...] = tuple(
    k for k in SECTIONS[""] if k not in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler",
                                         "communication_data_type", "managed_gradient_accumulation", "nvme_swap")
)
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_FLAT_TOP = ("gradient_clipping", "communication_data_type", "managed_gradient_accumulation", "nvme_swap")


def is_deepspeed_shaped(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` is DeepSpeed's nested shape (a DeepSpeed-only key, or an optimizer with ``params``)."""
    opt = values.get("optimizer")
    return any(k in values for k in DEEPSPEED_ONLY_KEYS) or (isinstance(opt, Mapping) and "params" in opt)


def deepspeed_to_flat(values: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed's nested config as the flat keys of
    :class:`~reference.contract.accumulation_config.AccumulationConfig` (docs/zero.md, "DeepSpeed-style config"
    and its mapping table), which validates the values; this module knows the keys, that one the values.

    Defaults are DeepSpeed's where they differ from the flat config's: ``gradient_clipping`` 0 (off), optimizer
    ``Adam`` with ``adam_w_mode`` true (``adamw``). With ``world_size`` one batch key may be left out (or
    ``"auto"``) and is derived. Every problem of every section is refused together.
    """
    problems = ConfigProblems()
    out: dict[str, Any] = {"gradient_clipping": 0.0}
    _section_rules("", values, problems)
    for key in _FLAT_TOP:
        if key in values:
            if is_auto(values[key]):
                problems.add(key, _auto_hint(key))
            else:
                out[key] = values[key]
    _precision(values, out, problems)
    if "zero_optimization" in values:
        _zero(values["zero_optimization"], out, problems)
    if "aio" in values:
        _aio(values["aio"], "nvme_swap" in values, out, problems)
    lr = _optimizer(values.get("optimizer"), out, problems)
    peak = _scheduler(values.get("scheduler"), lr, out, problems)
    if is_auto(lr):
        if peak is None:
            problems.add("optimizer.params.lr", _auto_hint("optimizer.params.lr"))
        else:
            out["optimizer"]["lr"] = peak
    _batch(values, world_size, out, problems)
    problems.raise_if_any("DeepSpeed config")
    return out


# ---- per-key rules -------------------------------------------------------------------------------------------

_AUTO_HINTS = {
    "gradient_clipping": "put HF's max_grad_norm (1.0 unless set), or 0 for no clipping",
    "optimizer.params.lr": "put the learning rate, or give the scheduler's peak (warmup_max_lr, cycle_max_lr, "
                           "lr_range_test_min_lr) a number to take it from",
    "scheduler.params.warmup_max_lr": "put the peak learning rate, or give optimizer.params.lr a number to take "
                                      "it from",
    "scheduler.params.total_num_steps": "put the number of boundaries (optimizer steps) of the run (HF: max_steps)",
    "scheduler.params.warmup_num_steps": "put the number of warm-up boundaries (HF: warmup_steps, >= 1)",
    "optimizer.params.betas": "put HF's [adam_beta1, adam_beta2] ([0.9, 0.999] unless set)",
    "optimizer.params.eps": "put HF's adam_epsilon (1e-8 unless set)",
    "optimizer.params.weight_decay": "put HF's weight_decay (0.0 unless set)",
    "bf16.enabled": "put true for a bf16 model, false for fp32",
    "fp16.enabled": "put false (fp16 is not supported here; bf16.enabled: true for 16-bit)",
}


def _auto_hint(key: str) -> str:
    """Why ``"auto"`` cannot be resolved at ``key``, and what to put instead."""
    hint = _AUTO_HINTS.get(key, "put the number HF's Trainer would have written there")
    return f"'auto' cannot be derived from the rest of the config (no HF Trainer fills it here); {hint}"


def _section_rules(where: str, section: Mapping[str, Any], problems: ConfigProblems) -> None:
    """Unknown keys (with a close match if there is one), refused keys, and no-effect keys whose value would have
    an effect, of the section at dotted ``where``; honoured and mapped keys are the caller's."""
    table = SECTIONS[where]
    for key in sorted(section, key=str):
        dotted = f"{where}.{key}" if where else str(key)
        rule: KeyRule | None = table.get(key)
        if rule is None:
            close = difflib.get_close_matches(str(key), list(table), n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            usable = [k for k, r in table.items() if r.effect != "refused"]
            problems.add(dotted, f"unknown key; {guess}allowed keys{' of ' + where if where else ''}: "
                                 f"{', '.join(usable)}")
        elif rule.effect == "refused":
            problems.add(dotted, f"not supported: {rule.why}; allowed: {rule.allowed}")
        elif rule.effect == "no effect" and rule.accepts is not None and not rule.accepts(section[key]):
            problems.add(dotted, f"{section[key]!r} is not supported ({rule.why}); allowed values: {rule.allowed}")


def _mapping(where: str, value: Any, problems: ConfigProblems) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping):
        return value
    keys = ", ".join(SECTIONS.get(where, {}))
    problems.add(where, f"{value!r} must be a mapping{' with keys: ' + keys if keys else ''}")
    return None


# ---- sections ------------------------------------------------------------------------------------------------

def _precision(values: Mapping[str, Any], out: dict[str, Any], problems: ConfigProblems) -> None:
    """``bf16`` / ``fp16`` (``enabled``; fp16 only while off) and ``data_types.grad_accum_dtype``."""
    for name in ("bf16", "fp16"):
        if name not in values or (section := _mapping(name, values[name], problems)) is None:
            continue
        _section_rules(name, section, problems)
        flag = section.get("enabled", False)
        if is_auto(flag):
            problems.add(f"{name}.enabled", _auto_hint(f"{name}.enabled"))
        elif type(flag) is not bool:
            problems.add(f"{name}.enabled", f"{flag!r} must be a bool; allowed values: true, false")
        elif flag and name == "fp16":
            problems.add("fp16.enabled", "true is not supported (fp16 needs dynamic loss scaling, which this "
                                         "engine does not model); allowed: bf16.enabled: true, or fp32 (neither)")
        elif flag:
            out["dtype"] = "bf16"
    if "data_types" in values and (dt := _mapping("data_types", values["data_types"], problems)) is not None:
        problems.unknown_keys("data_types", dt, ("grad_accum_dtype",))
        if "grad_accum_dtype" in dt:
            out["grad_accum_dtype"] = dt["grad_accum_dtype"]


def _zero(value: Any, out: dict[str, Any], problems: ConfigProblems) -> None:
    """``zero_optimization``: stage, overlap, bucket sizes and the two offload sub-sections."""
    zero = _mapping("zero_optimization", value, problems)
    if zero is None:
        return
    _section_rules("zero_optimization", zero, problems)
    if "stage" in zero:
        out["zero_stage"] = zero["stage"]
    if "overlap_comm" in zero:
        out["overlap_comm"] = zero["overlap_comm"]
    buckets = {}
    for key, minimum in (("reduce_bucket_size", 1), ("allgather_bucket_size", 0)):
        if key in zero and not is_auto(zero[key]):
            size = size_value(zero[key])
            if size is None or size < minimum:
                problems.add(f"zero_optimization.{key}", f"{zero[key]!r} must be an element count (an int >= "
                                                         f"{minimum}, or an integral number such as 5e8) or 'auto'")
            else:
                buckets[key] = size
    chosen = buckets.get("reduce_bucket_size") or buckets.get("allgather_bucket_size")
    if chosen:
        out["bucket_elements"] = chosen
    for key in ("offload_optimizer", "offload_param"):
        if key in zero and (off := _mapping(f"zero_optimization.{key}", zero[key], problems)) is not None:
            _offload(key, off, out, problems)


def _offload(key: str, off: Mapping[str, Any], out: dict[str, Any], problems: ConfigProblems) -> None:
    _section_rules(f"zero_optimization.{key}", off, problems)
    out[key] = off.get("device", "none")
    for name, rule in SECTIONS[f"zero_optimization.{key}"].items():
        if rule.effect == "honoured" and name != "device" and name in off:
            out[name] = off[name]


def _aio(value: Any, has_swap: bool, out: dict[str, Any], problems: ConfigProblems) -> None:
    """``aio``: DeepSpeed's async-IO knobs onto this engine's ``nvme_swap`` (refused next to ``nvme_swap``)."""
    aio = _mapping("aio", value, problems)
    if aio is None:
        return
    _section_rules("aio", aio, problems)
    if has_swap:
        problems.add("aio", "both aio and nvme_swap set the swap handle's knobs; allowed: one of them")
        return
    names = {"block_size": "block_size", "queue_depth": "queue_depth", "thread_count": "num_threads",
             "intra_op_parallelism": "num_threads"}
    out["nvme_swap"] = {names[k]: v for k, v in aio.items() if k in names}


def _optimizer(value: Any, out: dict[str, Any], problems: ConfigProblems) -> Any:
    """``optimizer`` (type and params; DeepSpeed's ``Adam`` with ``adam_w_mode``) onto ``out["optimizer"]``;
    returns its ``lr`` as written (a number, ``"auto"``, or None) for the scheduler's resolution."""
    if value is None:
        return None
    opt = _mapping("optimizer", value, problems)
    if opt is None:
        return None
    problems.unknown_keys("optimizer", opt, ("type", "params"))
    params = _mapping("optimizer.params", opt.get("params", {}), problems) or {}
    _section_rules("optimizer.params", params, problems)
    kind = opt.get("type", "adamw")
    if not isinstance(kind, str) or kind.lower() not in {t.lower() for t in DEEPSPEED_OPTIMIZER_TYPES}:
        problems.add("optimizer.type", f"{kind!r} is not supported; allowed values: Adam, AdamW, SGD (any case)")
        kind = "adamw"
    kind = kind.lower()
    adam_w_mode = params.get("adam_w_mode", True)
    if type(adam_w_mode) is not bool:
        problems.add("optimizer.params.adam_w_mode", f"{adam_w_mode!r} must be a bool; allowed values: true, false")
    elif "adam_w_mode" in params and kind != "adam":
        problems.add("optimizer.params.adam_w_mode", f"applies to type 'Adam' only (got type {opt.get('type')!r})")
    elif kind == "adam" and adam_w_mode:
        kind = "adamw"  # DeepSpeed's Adam decouples weight decay unless adam_w_mode is false
    hyper = {}
    for name in ("lr", "betas", "eps", "weight_decay", "momentum"):
        if name in params:
            if is_auto(params[name]) and name != "lr":
                problems.add(f"optimizer.params.{name}", _auto_hint(f"optimizer.params.{name}"))
            elif not is_auto(params[name]):
                hyper[name] = params[name]
    out["optimizer"] = {"type": kind, **hyper}
    return params.get("lr")


def _scheduler(value: Any, lr: Any, out: dict[str, Any], problems: ConfigProblems) -> Any:
    """``scheduler`` onto ``out["scheduler"]`` (``"auto"`` values resolved where derivable); returns the
    schedule's peak lr (what an ``"auto"`` optimizer lr takes) or None."""
    if value is None:
        return None
    section = _mapping("scheduler", value, problems)
    if section is None:
        return None
    problems.unknown_keys("scheduler", section, ("type", "params"))
    kind = section.get("type")
    if kind not in SCHEDULER_TYPES:
        problems.add("scheduler.type", f"{kind!r} is not supported; allowed values: {', '.join(SCHEDULER_TYPES)}")
        return None
    params = dict(_mapping("scheduler.params", section.get("params", {}), problems) or {})
    problems.unknown_keys("scheduler.params", params, param_names(kind))
    for name in list(params):
        if not is_auto(params[name]):
            continue
        if name == "warmup_min_lr":
            params[name] = 0.0  # HF's Trainer always writes 0 here
        elif name == "warmup_max_lr" and lr is not None and not is_auto(lr):
            params[name] = lr  # HF fills both from one learning_rate
        else:
            problems.add(f"scheduler.params.{name}", _auto_hint(f"scheduler.params.{name}"))
            del params[name]
    for name in required_params(kind):
        if name not in params and not problems.has(f"scheduler.params.{name}"):
            problems.add(f"scheduler.params.{name}", f"required by type {kind!r} (no default in DeepSpeed either)")
    known = {k: v for k, v in params.items() if k in param_names(kind)}
    if set(required_params(kind)) <= set(known):
        built = problems.check("scheduler", lambda: SchedulerConfig.from_dict({"type": kind, "params": known}))
        if built is not None:
            out["scheduler"] = built
    peak_key = {"WarmupLR": "warmup_max_lr", "WarmupDecayLR": "warmup_max_lr", "OneCycle": "cycle_max_lr",
                "LRRangeTest": "lr_range_test_min_lr"}.get(kind)
    peak = known.get(peak_key) if peak_key else None
    return None if peak is None or is_auto(peak) else peak


def _batch(values: Mapping[str, Any], world_size: int | None, out: dict[str, Any], problems: ConfigProblems) -> None:
    """The three batch keys: one left out or ``"auto"`` is derived from the other two and the world size (an
    ``"auto"`` only then: two ``"auto"`` keys leave nothing to derive from)."""
    given = {k: values[k] for k in _BATCH if k in values}
    autos = [k for k, v in given.items() if is_auto(v)]
    numbers = {k: v for k, v in given.items() if not is_auto(v)}
    if autos and any(k not in numbers for k in _BATCH if k != autos[0]):  # a second "auto" is not a number
        for k in autos:
            problems.add(k, "'auto' is derived only when the other two batch keys are numbers; put numbers in at "
                            "least two of train_batch_size, train_micro_batch_size_per_gpu, "
                            "gradient_accumulation_steps")
        return
    if autos == ["train_batch_size"]:
        if world_size is not None:
            micro, gas = numbers["train_micro_batch_size_per_gpu"], numbers["gradient_accumulation_steps"]
            problems.check("train_batch_size", lambda: out.update(
                train_batch_size=_positive("train_micro_batch_size_per_gpu", micro)
                * _positive("gradient_accumulation_steps", gas) * world_size))
        out.update({k: v for k, v in numbers.items()})
        return
    problems.check("train_batch_size", lambda: _derive_batch(numbers, world_size, out))


def _positive(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1")
    return value


def _derive_batch(numbers: Mapping[str, Any], world_size: int | None, out: dict[str, Any]) -> None:
    """DeepSpeed's derivation: with ``train_batch_size``, a missing micro-batch size or gas follows from the
    other and the world size (both missing: gas 1)."""
    micro = numbers.get("train_micro_batch_size_per_gpu")
    gas = numbers.get("gradient_accumulation_steps")
    total = numbers.get("train_batch_size")
    if total is not None:
        _positive("train_batch_size", total)
        missing = [n for n, v in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas))
                   if v is None]
        if missing and world_size is None:
            raise ConfigurationError(
                f"train_batch_size without {' and '.join(missing)} needs the world size to derive "
                f"{'them' if len(missing) > 1 else 'it'}; allowed: give all three batch keys, or build the config "
                f"through an engine (which knows its world size)"
            )
        if micro is None and gas is None:
            gas = 1
        rem = 0
        if micro is None:
            assert world_size is not None  # a batch key to derive without the world size was refused above
            micro, rem = divmod(total, _positive("gradient_accumulation_steps", gas) * world_size)
        elif gas is None:
            assert world_size is not None  # as above
            gas, rem = divmod(total, _positive("train_micro_batch_size_per_gpu", micro) * world_size)
        if missing and (micro == 0 or gas == 0 or rem):
            raise ConfigurationError(
                f"train_batch_size={total} is not divisible into {' and '.join(missing)} at world_size="
                f"{world_size} (with the other batch key given); allowed: a train_batch_size that is a multiple"
            )
        out["train_batch_size"] = total
    if micro is not None:
        out["train_micro_batch_size_per_gpu"] = micro
    if gas is not None:
        out["gradient_accumulation_steps"] = gas

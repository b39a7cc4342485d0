"""The validated configuration of an activation-offload manager (a shared contract).

Both implementations take exactly this object, so a config written for one runs unchanged on the other, and
a bad knob is rejected with the same :class:`~reference.contract.errors.ConfigurationError` whichever implementation
the user picked. Validation happens at construction: a knob that is wrong must fail where it is written,
not in the middle of the first backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reference.contract.errors import ConfigurationError, allowed_values_error

#: Offload every saved activation that passes the never-offload rules and ``min_offload_bytes``.
MODE_ALL = "all"
#: Offload only tensors saved as inputs of a checkpointed region (torch's non-reentrant and reentrant
#: ``torch.utils.checkpoint``, hostoffload's own ``checkpoint``, and hidden states marked by the HF
# integration).
MODE_CHECKPOINT_INPUTS = "checkpoint_inputs"
MODES: tuple[str, ...] = (MODE_ALL, MODE_CHECKPOINT_INPUTS)

# Byte knobs are bounded so that arithmetic on them never overflows an int64 on the native side.
MAX_BYTES = 1 << 62
MAX_COUNT = 1 << 20


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    # bool is an int subclass, but True as a byte count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise ConfigurationError(f"{name}={value!r} is invalid; allowed: an int in [{low}, {high}]")
    return value


def _check_optional_int(name: str, value: Any, low: int, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise ConfigurationError(f"{name}={value!r} is invalid; allowed: None (no limit) or an int in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class OffloadConfig:
    """Knobs of an activation-offload manager.

    ``mode``: which saved tensors are candidates, :data:`MODE_ALL` or :data:`MODE_CHECKPOINT_INPUTS`.
    ``min_offload_bytes``: tensors whose bytes to move are below this stay on the device (moving small
    tensors costs more in latency than it saves in memory).
    ``keep_last_count``: the newest N candidates stay on the device; the first backward ops need them at
    once, so copying them out and straight back would only add a stall.
    ``prefetch_count``: how many tensors ahead (in backward order) a restore also starts copying back.
    ``max_inflight_bytes``: cap on bytes of copies issued but not yet consumed/complete (None: no cap);
    bounds the extra device memory that asynchronous copies keep alive.
    ``pool_bytes``: cap on host bytes holding offloaded data (None: no cap); a tensor that does not fit
    stays on the device.
    ``use_streams``: copy on side streams (True), synchronously (False), or decide from the accelerator
    (None). The reference implementation is always synchronous; it accepts the knob so configs are portable.
    ``hf_integration``: patch ``transformers.GradientCheckpointingLayer`` while the manager is active so it
    marks its hidden-states input as a checkpoint input (needs the optional ``transformers`` dependency).
    """

    mode: str = MODE_ALL
    min_offload_bytes: int = 1 << 20
    keep_last_count: int = 1
    prefetch_count: int = 1
    max_inflight_bytes: int | None = None
    pool_bytes: int | None = None
    use_streams: bool | None = None
    hf_integration: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise allowed_values_error("mode", self.mode, MODES)
        _check_int("min_offload_bytes", self.min_offload_bytes, 0, MAX_BYTES)
        _check_int("keep_last_count", self.keep_last_count, 0, MAX_COUNT)
        _check_int("prefetch_count", self.prefetch_count, 0, MAX_COUNT)
        _check_optional_int("max_inflight_bytes", self.max_inflight_bytes, 1, MAX_BYTES)
        _check_optional_int("pool_bytes", self.pool_bytes, 1, MAX_BYTES)
        if self.use_streams is not None and not isinstance(self.use_streams, bool):
            raise ConfigurationError(f"use_streams={self.use_streams!r} is invalid; allowed: True, False, None (auto)")
        if not isinstance(self.hf_integration, bool):
            raise ConfigurationError(f"hf_integration={self.hf_integration!r} is invalid; allowed: True, False")

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_knobs(cls, base: OffloadConfig | None = None, knobs: Mapping[str, Any] | None = None) -> OffloadConfig:
        """``base`` (default config if None) with ``knobs`` replaced; unknown knob names are a
        ConfigurationError.

        A plain dataclass would raise ``TypeError`` for a misspelt keyword; users deserve the list of real
        knobs.
        """
        if base is not None and not isinstance(base, OffloadConfig):
            raise ConfigurationError(f"config={base!r} is invalid; allowed: an OffloadConfig or None")
        knobs = dict(knobs or {})
        unknown = sorted(set(knobs) - set(cls.knob_names()))
        if unknown:
            raise ConfigurationError(
                f"unknown offload knob(s) {', '.join(unknown)}; allowed knobs: {', '.join(cls.knob_names())}"
            )
        base = base if base is not None else cls()
        return dataclasses.replace(base, **knobs) if knobs else base

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "MODES",
    "MODE_ALL",
    "MODE_CHECKPOINT_INPUTS",
    "OffloadConfig",
]

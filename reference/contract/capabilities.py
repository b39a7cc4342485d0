"""What an implementation declares about itself, as one typed, frozen value.

The conformance suite decides what to check from this declaration and from nothing else: it never looks at an
implementation's name, module attributes or class names. A feature that is not declared is skipped (with the
declaration named in the reason); a feature that is declared is checked in full. The fields are the whole
vocabulary: an unknown key is an error, so a typo cannot silently turn a check off.

Tests ask for a feature with ``@pytest.mark.requires(...)`` (see ``conformance.harness.capability_marks``); the names
accepted there are the field names below.

Contract: the vocabulary between an implementation and the suite; every implementation declares itself in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The pin backends the specification defines (mirrors reference.contract.envvars.PIN_BACKENDS; kept literal here
#: so this module imports nothing).
_PIN_BACKENDS = ("torch", "native")


def _frozen_env(variants: Any) -> tuple[tuple[tuple[str, str], ...], ...]:
    out = []
    for v in variants:
        if not isinstance(v, Mapping):
            raise TypeError(f"pin_env_variants entries must be mappings of environment variables, got {v!r}")
        out.append(tuple(sorted((str(k), str(x)) for k, x in v.items())))
    return tuple(out)


@dataclass(frozen=True)
class Capabilities:
    """Features and tolerances an implementation claims. Every field has the conservative default: claim
    nothing you have not implemented, because everything claimed is tested.

    - ``pin_backends``: which of ``torch`` and ``native`` the pinning area implements.
    - ``concurrent_registry_reads``: registry lookups do not serialise on one lock (sizes the contention test).
    - ``pinned_slab``: dotted path of a module with a ``PinnedSlab`` whose pieces ``is_pinned`` recognises.
    - ``pin_env_variants``: tuning environments the native pinning path must be correct under (each a mapping).
    - ``distributed_engine``: the accumulation area has a multi-process ``ZeroEngine`` (one object per rank, on
      a torch.distributed group); the engine tests take it, ``pinned_stats`` and the pinning API from the
      implementation's own area modules.
    - ``accumulation_rank_ordered_reduction``: reductions add per-rank terms in rank order (exact traces at
      every world size on cpu).
    - ``accumulation_optimizer_ulps``: the optimizer may differ from R16 by this many ulps (None: exact).
    - ``accumulation_delayed_parameter_update``: the accumulation area implements the opt-in one-step-delayed
      parameter update (docs/accumulation.md R27, config key ``delayed_parameter_update``); the suite runs its
      scenarios against the reference. Without it those scenarios are skipped.
    - ``accumulation_split_update``: the accumulation area implements R28's split update (config keys
      ``gpu_share``, ``gpu_memory_budget`` and ``gpu_memory_limit``; a distributed engine's ``split_report()``);
      without it the R28 tests are skipped.
    - ``accumulation_state_precision``: the accumulation area implements R29's compressed optimizer state (config
      key ``state_precision``: Adam's moments stored in bf16, rounded to nearest even); without it the R29
      tests are skipped.
    - ``accumulation_overlapped_update``: the accumulation area accepts R30's ``host_update_start`` (config key:
      "step" or "last_backward", the host update started under the boundary's last backward with R15's arithmetic
      kept exact) and a distributed engine reports it (``overlap_report()``); without it the R30 tests are
      skipped. With ``accumulation_split_update`` too, it accepts R30 with R28's split.
    - ``accumulation_host_memory_estimate``: the distributed engine's class has
      ``estimate_host_memory(module, config, *, world_size=1, device="cuda")``, which lists the host buffers one
      rank's engine will allocate (an object with ``buffers``, ``pinned_bytes``, ``locked_bytes`` and
      ``total_bytes``) before any is allocated; the suite compares it with the locked memory the operating system
      counts for the built engine.
    - ``accumulation_checkpoint``: the distributed engine implements ``save_checkpoint`` / ``load_checkpoint``
      with the guarantees of docs/zero.md ("Checkpoints: what is guaranteed": atomic saves that leave the
      previous checkpoint on any failure, checksummed files, clear errors); the suite's resume tests and its
      checkpoint state machine with fault injection run against every implementation that declares it.
    - ``range_address_limit``: the exclusive upper bound on the addresses, sizes and owner tokens the ranges
      area's ``RangeRegistry`` stores (e.g. ``2**64`` for a registry of 64-bit words); values from it up must be a
      ``ConfigurationError``. None: unbounded, like the reference's.
    - ``offload_streams``: the offload area moves data on accelerator streams (asynchronous-accelerator tests).
    - ``io_streams``: the io area's transfers run on accelerator streams (asynchronous-accelerator tests).
    - ``crash_isolation``: run tests that drive this implementation's native code in a child process, so a
      crash is one failed test. On by default; an implementation may turn it off only where its native code
      has been shown not to crash the suite (the harness still isolates tests marked ``isolated``).
    """

    pin_backends: tuple[str, ...] = ()
    concurrent_registry_reads: bool = False
    pinned_slab: str | None = None
    pin_env_variants: tuple[tuple[tuple[str, str], ...], ...] = ()
    distributed_engine: bool = False
    accumulation_rank_ordered_reduction: bool = False
    accumulation_optimizer_ulps: int | None = None
    accumulation_delayed_parameter_update: bool = False
    accumulation_split_update: bool = False
    accumulation_state_precision: bool = False
    accumulation_overlapped_update: bool = False
    accumulation_checkpoint: bool = False
    accumulation_host_memory_estimate: bool = False
    range_address_limit: int | None = None
    offload_streams: bool = False
    io_streams: bool = False
    crash_isolation: bool = True

    def __post_init__(self) -> None:
        backends = tuple(self.pin_backends)
        bad = [b for b in backends if b not in _PIN_BACKENDS]
        if bad:
            raise ValueError(f"pin_backends={backends!r}: unknown {bad}; allowed values: {', '.join(_PIN_BACKENDS)}")
        object.__setattr__(self, "pin_backends", backends)
        variants = self.pin_env_variants
        if variants and not all(isinstance(v, tuple) for v in variants):
            object.__setattr__(self, "pin_env_variants", _frozen_env(variants))
        for name in ("concurrent_registry_reads", "distributed_engine", "accumulation_rank_ordered_reduction",
                     "accumulation_delayed_parameter_update", "accumulation_split_update",
                     "accumulation_state_precision", "accumulation_overlapped_update",
                     "accumulation_checkpoint", "accumulation_host_memory_estimate", "offload_streams",
                     "io_streams", "crash_isolation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        ulps = self.accumulation_optimizer_ulps
        if ulps is not None and (type(ulps) is not int or ulps < 0):
            raise ValueError(f"accumulation_optimizer_ulps={ulps!r} must be None or an int >= 0")
        limit = self.range_address_limit
        if limit is not None and (type(limit) is not int or limit <= 0):
            raise ValueError(f"range_address_limit={limit!r} must be None or a positive int")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Capabilities:
        """The typed form of a plain mapping (the older ``capabilities={...}`` spelling); unknown keys raise."""
        known = cls.names()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; allowed names: {', '.join(known)}")
        return cls(**dict(values))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def env_variants(self) -> tuple[dict[str, str], ...]:
        """``pin_env_variants`` as dictionaries, ready for ``os.environ.update``."""
        return tuple(dict(v) for v in self.pin_env_variants)

    def declares(self, name: str, value: Any = True) -> bool:
        """Whether the feature ``name`` is declared: a truthy flag/value, or, for tuple-valued fields, that
        ``value`` is among the declared items (``declares("pin_backends", "native")``)."""
        if name not in self.names():
            raise ValueError(f"unknown capability {name!r}; allowed names: {', '.join(self.names())}")
        have = getattr(self, name)
        if isinstance(have, tuple) and value is not True:
            return value in have
        return bool(have) if value is True else have == value

    def summary(self) -> str:
        """The declared (non-default) fields, for listings and reports."""
        default = Capabilities()
        parts = [f"{f}={getattr(self, f)!r}" for f in self.names() if getattr(self, f) != getattr(default, f)]
        return ", ".join(parts) or "(none)"


__all__ = ["Capabilities"]

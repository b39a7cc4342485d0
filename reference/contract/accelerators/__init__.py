"""Accelerator discovery.

Accelerators come from the ``hostoffload.accelerators`` entry-point group: hostoffload's own ``cpu`` and ``cuda``
are registered there exactly like a vendor's would be, so there is one path for all of them. Each entry point
names a class (or a zero-argument factory) returning an :class:`Accelerator`.

``HOSTOFFLOAD_ACCELERATOR`` forces one by name; otherwise the default is the first available accelerator that is not
``cpu`` and declares ``may_be_default`` (in entry-point name order, for determinism), and ``cpu`` is the fallback.
Test-only accelerators declare ``may_be_default = False``, so installing one never changes the default.

Contract: every implementation resolves devices through this one registry, so that ``HOSTOFFLOAD_ACCELERATOR``
and the default choice mean the same whichever implementation runs.
"""

from __future__ import annotations

import os
import threading
from importlib.metadata import entry_points

from reference.contract.accelerators.base import Accelerator
from reference.contract.envvars import ACCELERATOR_ENV, accelerator_name
from reference.contract.errors import ConfigurationError, UnknownPluginError

__all__ = [
    "ACCELERATOR_ENTRY_POINT_GROUP",
    "Accelerator",
    "default_accelerator",
    "discover_accelerators",
    "get_accelerator",
]

ACCELERATOR_ENTRY_POINT_GROUP = "hostoffload.accelerators"

_lock = threading.Lock()
_instances: dict[str, Accelerator] = {}


def discover_accelerators() -> dict[str, Accelerator]:
    """Every installed accelerator, instantiated once per process, keyed by entry-point name (sorted)."""
    with _lock:
        if not _instances:
            found: dict[str, Accelerator] = {}
            for ep in sorted(entry_points(group=ACCELERATOR_ENTRY_POINT_GROUP), key=lambda e: e.name):
                if ep.name in found:
                    continue
                obj = ep.load()()
                if not isinstance(obj, Accelerator):
                    raise TypeError(
                        f"entry point {ACCELERATOR_ENTRY_POINT_GROUP}:{ep.name} = {ep.value} produced "
                        f"{type(obj).__name__}, not a reference.contract.accelerators.Accelerator"
                    )
                if obj.name != ep.name:
                    raise TypeError(
                        f"accelerator {type(obj).__name__} is named {obj.name!r} but registered as {ep.name!r}; "
                        "the two must match"
                    )
                found[ep.name] = obj
            _instances.update(found)
        return dict(_instances)


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator named ``name``, else the one ``HOSTOFFLOAD_ACCELERATOR`` names, else the default."""
    known = discover_accelerators()
    source = "name"
    if name is None:
        # The variable follows the one rule of reference.contract.envvars: stripped, case-insensitive, blank = unset.
        wanted = accelerator_name()
        name = None if wanted is None else next((k for k in known if k.lower() == wanted), os.environ[ACCELERATOR_ENV])
        source = ACCELERATOR_ENV
    if name is not None:
        accelerator = known.get(name)
        if accelerator is None:
            raise UnknownPluginError(
                f"{source}={name!r} names no installed accelerator; allowed values: {', '.join(sorted(known))}"
            )
        if not accelerator.is_available():
            raise ConfigurationError(
                f"{source}={name!r} names an accelerator that is not available on this machine; available: "
                f"{', '.join(n for n, a in sorted(known.items()) if a.is_available())}"
            )
        return accelerator
    return default_accelerator(known)


def default_accelerator(known: dict[str, Accelerator] | None = None) -> Accelerator:
    """What runs when nobody names an accelerator: the first available one that may be a default, else cpu."""
    known = discover_accelerators() if known is None else known
    for name, accelerator in sorted(known.items()):
        if name != "cpu" and accelerator.may_be_default and accelerator.is_available():
            return accelerator
    if "cpu" not in known:
        raise UnknownPluginError("no accelerator is installed (entry-point group hostoffload.accelerators is empty)")
    return known["cpu"]

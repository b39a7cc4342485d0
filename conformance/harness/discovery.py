"""Finding implementations and accelerators through entry points, and applying the user's selection.

The suite never names an implementation or an accelerator: whatever is installed under the
``hostoffload.implementations`` and ``hostoffload.accelerators`` groups is what runs, narrowed only by the
``--conformance-impl`` and ``--conformance-accelerator`` options.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from conformance.harness.option_checks import IMPLEMENTATION_GROUP, split_names, unknown_names_error
from reference.contract.accelerators import Accelerator, discover_accelerators
from reference.contract.implementation import Implementation

IMPLEMENTATION_ENTRY_POINT_GROUP = IMPLEMENTATION_GROUP


def discover_implementations() -> dict[str, Implementation]:
    """Every installed implementation, keyed by entry-point name, in name order."""
    found: dict[str, Implementation] = {}
    for ep in sorted(entry_points(group=IMPLEMENTATION_ENTRY_POINT_GROUP), key=lambda e: e.name):
        obj = ep.load()
        if callable(obj) and not isinstance(obj, Implementation):
            obj = obj()
        if not isinstance(obj, Implementation):
            raise TypeError(
                f"entry point {IMPLEMENTATION_ENTRY_POINT_GROUP}:{ep.name} = {ep.value} is "
                f"{type(obj).__name__}, not a reference.contract.implementation.Implementation"
            )
        if obj.name != ep.name:
            raise TypeError(f"implementation {obj.name!r} is registered as {ep.name!r}; the two must match")
        found.setdefault(ep.name, obj)
    return found


def select_implementations(requested: list[str] | None) -> list[Implementation]:
    known = discover_implementations()
    names = split_names(requested)
    if not names:
        return list(known.values())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise unknown_names_error("--conformance-impl", "implementation", unknown, list(known))
    return [known[n] for n in dict.fromkeys(names)]


def select_accelerators(requested: list[str] | None) -> tuple[list[Accelerator], list[Accelerator]]:
    """(selected, unavailable): by default every available accelerator; named ones must exist."""
    known = discover_accelerators()
    names = split_names(requested)
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise unknown_names_error("--conformance-accelerator", "accelerator", unknown, list(known))
        chosen = [known[n] for n in dict.fromkeys(names)]
    else:
        chosen = list(known.values())
    selected = [a for a in chosen if a.is_available()]
    unavailable = [a for a in chosen if not a.is_available()]
    return selected, unavailable


def discover_available_accelerators() -> list[Accelerator]:
    """The installed accelerators usable on this machine, in name order."""
    return [a for a in discover_accelerators().values() if a.is_available()]

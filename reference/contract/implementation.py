"""The descriptor an implementation registers under the ``hostoffload.implementations`` entry point.

The conformance suite learns everything it needs about an implementation from this object: its name, which
areas of the specification it provides, and its capability flags. Areas are loaded lazily, so a broken or
missing area makes only that area's tests fail (or skip, if it is not declared), never the whole run.

Contract: the one object every implementation (ours and third parties') hands the suite through the entry
point.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

from reference.contract import interfaces
from reference.contract.capabilities import Capabilities

#: Every area of the specification, in the order the report lists them.
#: ``optimizer_kernels``: Adam / AdamW kernels judged against R16 on their own (reference.contract.optimizer_kernels),
#: so that a package shipping only a kernel can declare it.
AREAS: tuple[str, ...] = ("pinning", "ranges", "offload", "accumulation", "io", "optimizer_kernels")


@dataclass(frozen=True)
class Implementation:
    """An implementation of some areas of the hostoffload specification.

    ``areas`` maps an area name (one of :data:`AREAS`) to the dotted path of the module implementing it.
    ``capabilities`` is the one typed declaration of features and tolerances the suite reads instead of
    special-casing implementations (:class:`~reference.contract.capabilities.Capabilities`; a plain mapping is accepted
    and converted, unknown keys are an error).
    ``unsupported`` maps single calls of a declared area (``"<area>.<name>"``, a member of the area's protocol in
    :mod:`reference.contract.interfaces`) to the reason they are not provided: the suite skips the interface
    check of that name and every test marked as exercising it (``requires(calls=...)``) with this reason, and
    the report shows it. Everything else of the area is judged in full.
    """

    name: str
    version: str
    areas: dict[str, str] = field(default_factory=dict)
    capabilities: Capabilities = field(default_factory=Capabilities)
    unsupported: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.areas) - set(AREAS))
        if unknown:
            raise ValueError(
                f"Implementation {self.name!r} declares unknown areas {unknown}; allowed areas: {', '.join(AREAS)}"
            )
        caps = self.capabilities
        if isinstance(caps, Mapping):
            caps = Capabilities.from_mapping(caps)
        if not isinstance(caps, Capabilities):
            raise TypeError(
                f"Implementation {self.name!r}: capabilities must be a reference.contract.capabilities.Capabilities "
                f"(or a mapping of its field names), got {type(caps).__name__}"
            )
        object.__setattr__(self, "capabilities", caps)
        object.__setattr__(self, "unsupported", self._checked_unsupported(dict(self.unsupported)))

    def _checked_unsupported(self, unsupported: dict[str, str]) -> dict[str, str]:
        for call, reason in unsupported.items():
            area, _, name = str(call).partition(".")
            if area not in self.areas:
                raise ValueError(
                    f"Implementation {self.name!r}: unsupported call {call!r} must be '<area>.<name>' with an area "
                    f"it declares ({', '.join(self.areas) or 'none declared'})"
                )
            if name not in interfaces.call_names(area):
                raise ValueError(
                    f"Implementation {self.name!r}: unsupported call {call!r} is not in the {area} interface; "
                    f"allowed names: {', '.join(interfaces.call_names(area))}"
                )
            if not isinstance(reason, str) or not reason.strip():
                raise ValueError(f"Implementation {self.name!r}: unsupported call {call!r} needs a reason (a "
                                 f"non-empty string), got {reason!r}")
        return unsupported

    def unsupported_reason(self, call: str) -> str | None:
        """Why ``call`` (``"<area>.<name>"``) is declared unsupported, or None when it is provided."""
        return self.unsupported.get(call)

    def provides(self, area: str) -> bool:
        """True if the area is declared and its module can be found (not yet imported)."""
        path = self.areas.get(area)
        if path is None:
            return False
        try:
            return importlib.util.find_spec(path) is not None
        except ModuleNotFoundError:
            return False

    def load(self, area: str) -> ModuleType:
        """Import and return the module implementing ``area``."""
        try:
            path = self.areas[area]
        except KeyError:
            raise LookupError(f"implementation {self.name!r} does not provide area {area!r}") from None
        return importlib.import_module(path)

__all__ = [
    "AREAS",
    "Implementation",
]

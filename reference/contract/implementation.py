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

from reference.contract.capabilities import Capabilities

#: Every area of the specification, in the order the report lists them.
AREAS: tuple[str, ...] = ("pinning", "ranges", "offload", "accumulation", "io")


@dataclass(frozen=True)
class Implementation:
    """An implementation of some areas of the hostoffload specification.

    ``areas`` maps an area name (one of :data:`AREAS`) to the dotted path of the module implementing it.
    ``capabilities`` is the one typed declaration of features and tolerances the suite reads instead of
    special-casing implementations (:class:`~reference.contract.capabilities.Capabilities`; a plain mapping is accepted
    and converted, unknown keys are an error).
    """

    name: str
    version: str
    areas: dict[str, str] = field(default_factory=dict)
    capabilities: Capabilities = field(default_factory=Capabilities)

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

"""The catalog of the contract: every class of ``reference.contract`` a plugin author meets, by name.

The protocols of :mod:`reference.contract.interfaces` name most of them (re-exported types, parameter and result
types); registering and erring add the rest (:class:`~reference.contract.implementation.Implementation`,
:class:`~reference.contract.capabilities.Capabilities`, :class:`~reference.contract.accelerators.Accelerator`,
every public error of :mod:`reference.contract.public_errors`). It sits above both ``interfaces`` and
``implementation`` (which validates declared ``unsupported`` calls against ``interfaces``), so neither has to
import the other back. docs/extending.md lists where each type lives; a self-test holds that list, and
docs/changelog.md, to the code.

Contract: read by the suite's self-tests (a plugin author's tooling may read it too).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from reference.contract.accelerators import Accelerator
from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation
from reference.contract.interfaces import PROTOCOLS, contract_namespace, protocol_members
from reference.contract.public_errors import PUBLIC_ERRORS

__all__ = ["contract_types"]


def contract_types() -> dict[str, type]:
    """Every class of ``reference.contract`` a plugin author meets, by name: those the protocols name (re-exported
    types, parameter and result types) and what registering and erring take (``Implementation``,
    ``Capabilities``, ``Accelerator``, every public error). docs/extending.md lists where each lives, and a
    self-test holds that list, and docs/changelog.md, to where they are (a move cannot go unannounced)."""
    namespace = contract_namespace()
    found: dict[str, type] = {}

    def walk(hint: Any) -> None:
        if isinstance(hint, type) and hint.__module__.startswith("reference.contract") and not getattr(
                hint, "_is_protocol", False):
            found[hint.__name__] = hint
        for arg in typing.get_args(hint):
            walk(arg)

    for protocol in PROTOCOLS:
        for hint in typing.get_type_hints(protocol, globalns=namespace, localns=namespace).values():
            walk(hint)
        for name in protocol_members(protocol):
            member = protocol.__dict__.get(name)
            if inspect.isfunction(member):
                for hint in typing.get_type_hints(member, globalns=namespace, localns=namespace).values():
                    walk(hint)
    for cls in (Implementation, Capabilities, Accelerator, *PUBLIC_ERRORS):
        found[cls.__name__] = cls
    return found

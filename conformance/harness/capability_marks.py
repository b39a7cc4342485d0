"""``@pytest.mark.requires(...)``: a test states what it needs from the implementation; the harness decides at
collection, from the implementation's typed declaration (:class:`reference.contract.capabilities.Capabilities`).

    @pytest.mark.requires("distributed_engine")                 # a declared flag
    @pytest.mark.requires(pin_backends="native")                # an item of a tuple-valued capability
    @pytest.mark.requires(areas=("io", "pinning"))              # areas the implementation provides
    @pytest.mark.requires(calls=("pinning.pin_empty_like",))    # single calls it does not declare unsupported

A test whose requirement is not met is skipped before it runs, with a reason naming the missing declaration
(the report lists it), so a partial implementation is never failed for a feature it does not claim, and no test
body decides by itself whether it applies. An unknown capability name is a collection error: a misspelt
requirement must not silently skip a test.

A test that exercises one call of an area says so with ``calls=``; an implementation that declares that call
unsupported (``Implementation.unsupported``) has the test skipped with its own reason. A test parametrized
with ``call`` (a string naming a member of its area's interface, ``reference.contract.interfaces``) gets that
requirement without the mark, as a ``pin_backend`` parameter gets ``requires(pin_backends=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from reference.contract import interfaces
from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation

MARKER = "requires"


def register(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(*flags, areas=(...), calls=(...), **items): skip unless the implementation declares these "
        "capabilities (reference.contract.capabilities.Capabilities), provides these areas and does not declare "
        "these calls ('<area>.<name>') unsupported",
    )


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, str) or not isinstance(value, Iterable):
        return (value,)
    return tuple(value)


def unmet(impl: Implementation, marks: Iterable[pytest.Mark]) -> str | None:
    """The reason ``impl`` does not meet ``marks`` (``requires`` marks), or None when it meets all of them."""
    names = Capabilities.names()
    for mark in marks:
        for flag in mark.args:
            if flag not in names:
                raise pytest.UsageError(f"requires({flag!r}): unknown capability; allowed names: {', '.join(names)}")
            if not impl.capabilities.declares(flag):
                return f"{impl.name} does not declare capability {flag}"
        for key, wanted in mark.kwargs.items():
            if key == "areas":
                for area in _as_tuple(wanted):
                    if not impl.provides(area):
                        how = "declared but its module is missing" if area in impl.areas else "not declared"
                        return f"{impl.name} does not provide area '{area}' ({how})"
                continue
            if key == "calls":
                reason = _unsupported_call(impl, _as_tuple(wanted))
                if reason is not None:
                    return reason
                continue
            if key not in names:
                raise pytest.UsageError(f"requires({key}=...): unknown capability; allowed names: {', '.join(names)}")
            for item in _as_tuple(wanted):
                if not impl.capabilities.declares(key, item):
                    return f"{impl.name} declares {key}={getattr(impl.capabilities, key)!r}, not {item!r}"
    return None


def _unsupported_call(impl: Implementation, calls: tuple) -> str | None:
    for call in calls:
        area, _, name = str(call).partition(".")
        if area not in interfaces.AREA_INTERFACES or name not in interfaces.call_names(area):
            raise pytest.UsageError(f"requires(calls={call!r}): not '<area>.<name>' of an area's interface "
                                    "(reference.contract.interfaces)")
        reason = impl.unsupported_reason(call)
        if reason is not None:
            return f"{impl.name} declares {call} unsupported: {reason}"
    return None


def _call_parameter(item: pytest.Item, params: dict[str, Any]) -> str | None:
    """``"<area>.<call>"`` for a test parametrized with ``call`` naming a member of its area's interface."""
    call = params.get("call")
    marker = item.get_closest_marker("conformance_area")
    area = marker.args[0] if marker else None
    if isinstance(call, str) and area in interfaces.AREA_INTERFACES and call in interfaces.call_names(area):
        return f"{area}.{call}"
    return None


def apply(items: list[pytest.Item]) -> None:
    """Add a skip marker (with the reason) to every parametrized item whose implementation misses a requirement."""
    for item in items:
        marks = list(item.iter_markers(MARKER))
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("pin_backend")
        if backend is not None:  # the suite's pin_backend fixture: one case per backend the spec defines
            marks.append(pytest.mark.requires(pin_backends=backend).mark)
        call = _call_parameter(item, params)
        if call is not None:
            marks.append(pytest.mark.requires(calls=(call,)).mark)
        if not marks:
            continue
        impl = params.get("impl")
        if impl is None:
            raise pytest.UsageError(f"{item.nodeid} is marked requires(...) but does not take the impl fixture")
        reason = unmet(impl, marks)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))

"""Each declared area module provides its interface (``reference.contract.interfaces``): every name, contract
types re-exported as themselves, signatures that accept every call the suite makes, and ``__all__`` (where the
module has one) listing them. Names the implementation declares unsupported are left out of the check; the
report shows the reasons through the tests that exercise them."""

from __future__ import annotations

import pytest

from conformance.harness.interface_check import interface_problems
from reference.contract.interfaces import AREA_INTERFACES, call_names

AREAS = [pytest.param(area, marks=pytest.mark.conformance_area(area), id=area) for area in AREA_INTERFACES]


@pytest.mark.parametrize("area", AREAS)
def test_area_module_provides_its_interface(impl, area):
    module = impl.load(area)
    problems = interface_problems(module, area, impl.capabilities, impl.unsupported)
    exported = getattr(module, "__all__", None)
    if exported is not None:
        for name in call_names(area):
            if hasattr(module, name) and name not in exported and f"{area}.{name}" not in impl.unsupported:
                problems.append(f"{area}.{name}: provided but not listed in {module.__name__}.__all__")
    assert not problems, f"{impl.name}'s {area} module {module.__name__}:\n" + "\n".join(problems)

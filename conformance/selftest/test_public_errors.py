"""Every public error of hostoffload is one class object, importable wherever the README promises it.

The contract defines the classes and lists them once (``reference.contract.public_errors``); hostoffload's two
implementations re-export that list from their top level and their ``errors`` module (``optimized``,
``optimized.errors``, ``reference``, ``reference.errors``), and each area module that offers an error by name
offers the contract's class itself. A class added to the contract without joining the list, a copy defined
beside the contract's, or a name a package forgot, fails here. (Like test_contract_interfaces, this self-test holds
hostoffload's own implementations by name; the suite never names one.)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import reference.contract
from conformance.harness.discovery import discover_implementations
from reference.contract.errors import HostOffloadError
from reference.contract.public_errors import PUBLIC_ERRORS
from reference.contract.public_errors import __all__ as PUBLIC_NAMES

pytestmark = pytest.mark.conformance_area("harness")

#: hostoffload's own implementations, and the modules of each that re-export every public error.
OURS = ("reference", "optimized")
ERROR_MODULES = tuple(m for name in OURS for m in (name, f"{name}.errors"))


def contract_errors() -> dict[str, type]:
    """Every subclass of HostOffloadError that a module of ``reference.contract`` defines, by name."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(reference.contract.__path__, "reference.contract."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, HostOffloadError)
                    and value.__module__ == module.__name__):
                found[name] = value
    return found


def test_the_list_names_every_error_the_contract_defines():
    defined = contract_errors()
    assert "CheckpointError" in defined and "SwapIOError" in defined, sorted(defined)  # the walk found both files
    missing = sorted(set(defined) - set(PUBLIC_NAMES))
    assert not missing, f"contract errors missing from reference.contract.public_errors.__all__: {missing}"
    assert list(PUBLIC_ERRORS) == [defined[n] for n in PUBLIC_NAMES], "PUBLIC_ERRORS is not __all__'s classes"


@pytest.mark.parametrize("module_name", ERROR_MODULES)
def test_every_public_error_is_importable_as_the_contracts_class(module_name):
    module = importlib.import_module(module_name)
    exported = set(getattr(module, "__all__", ()))
    problems = []
    for cls in PUBLIC_ERRORS:
        value = getattr(module, cls.__name__, None)
        if value is None:
            problems.append(f"{cls.__name__}: not importable")
        elif value is not cls:
            problems.append(f"{cls.__name__}: {value.__module__}.{value.__qualname__}, not {cls.__module__}'s class")
        elif cls.__name__ not in exported:
            problems.append(f"{cls.__name__}: missing from __all__")
    assert not problems, f"{module_name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", OURS)
def test_area_modules_offer_the_contracts_error_classes_themselves(name):
    """An area module may offer only some errors (io: the swap errors), but each one it offers by a public
    error's name is that class, not a subclass or a copy."""
    impl = discover_implementations()[name]
    by_name = {cls.__name__: cls for cls in PUBLIC_ERRORS}
    problems = []
    for area in impl.areas:
        module = impl.load(area)
        for attr in set(getattr(module, "__all__", ())) & set(by_name):
            if getattr(module, attr) is not by_name[attr]:
                problems.append(f"{module.__name__}.{attr}")
    assert not problems, f"not the contract's class: {problems}"

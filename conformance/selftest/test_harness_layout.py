"""The harness's layout by role (issue 51 item 6): the old flat module names still import, with a warning.

Until December 2026 the harness's helpers were modules of ``conformance`` itself; a vendor's own tests may import
them by those names. Each old name must give the very module now at its new place (one module object: a pool or
a registry is not duplicated) and a ``DeprecationWarning`` naming the new place; a name that never existed must
still fail as usual.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest

import conformance

pytestmark = pytest.mark.conformance_area("harness")

MOVED = sorted(conformance._MOVED.items())


@pytest.mark.parametrize(("old", "package"), MOVED, ids=[m for m, _ in MOVED])
def test_an_old_name_imports_the_new_module_with_a_warning(old, package):
    new = importlib.import_module(f"conformance.{package}.{old}")
    sys.modules.pop(f"conformance.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"conformance\.{old} moved to conformance\.{package}\.{old}"):
        aliased = importlib.import_module(f"conformance.{old}")
    assert aliased is new, "the old name gave another module object"
    assert new.__spec__.name == new.__name__ == f"conformance.{package}.{old}", "the alias changed the module's spec"


def test_every_moved_module_exists_where_the_table_says_and_nothing_else_is_aliased():
    for package in ("harness", "areas", "faults"):
        here = {m.name for m in pkgutil.iter_modules(importlib.import_module(f"conformance.{package}").__path__)}
        assert here == {old for old, p in conformance._MOVED.items() if p == package}, package
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("conformance.no_such_helper")

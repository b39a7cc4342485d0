"""The plugin author's contract (``reference.contract.interfaces``) holds for hostoffload's own implementations,
its checker catches each kind of departure from it, and a single call declared unsupported is skipped with its
reason, in the run and in the report."""

from __future__ import annotations

import importlib
import json
import os
import re
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from conformance.harness.discovery import discover_implementations
from conformance.harness.interface_check import interface_problems
from conformance.selftest.plugins import partial_pinning
from conformance.selftest.runner import source_root
from conformance.selftest.test_harness import run_pytest
from reference.contract.capabilities import Capabilities
from reference.contract.catalog import contract_types
from reference.contract.implementation import Implementation
from reference.contract.interfaces import AREA_INTERFACES, call_names

pytestmark = pytest.mark.conformance_area("harness")

#: hostoffload's own implementations: the self-test holds both to the contract by name (the suite never names one).
OURS = ("reference", "optimized")


@pytest.mark.parametrize("name", OURS)
def test_our_public_modules_list_their_interface_in___all__(name):
    """Each area module of ours has ``__all__``; it names only what exists, lists every name of the area's
    interface the module provides, and the module passes the interface check (names, contract types,
    signatures)."""
    impl = discover_implementations()[name]
    assert set(impl.areas) == set(AREA_INTERFACES), f"{name} should provide every area"
    for area in impl.areas:
        module = impl.load(area)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{module.__name__} has no __all__"
        stale = [n for n in exported if not hasattr(module, n)]
        assert not stale, f"{module.__name__}.__all__ names what it does not define: {stale}"
        unlisted = [n for n in call_names(area) if hasattr(module, n) and n not in exported]
        assert not unlisted, f"{module.__name__}.__all__ lacks interface names {unlisted}"
        problems = interface_problems(module, area, impl.capabilities, impl.unsupported)
        assert not problems, "\n".join(problems)


def _copy(area: str) -> types.ModuleType:
    """A module with exactly the reference area module's public names (what a port starts from)."""
    source = discover_implementations()["reference"].load(area)
    module = types.ModuleType(f"copy_of_{source.__name__}")
    module.__dict__.update({n: getattr(source, n) for n in source.__all__})
    return module


def _defective_registry(module):
    class RangeRegistry(module.RangeRegistry):
        find = None  # a registry without lookups

    return RangeRegistry


class _NativeLike:
    """A callable that hides its signature from ``inspect`` (as a pybind11 function does) and states it in the
    first docstring line."""

    __signature__ = "unreadable"  # inspect.signature raises TypeError for it

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __call__(self, *args, **kwargs):
        raise AssertionError("never called by the check")


def _engine_with_only_init():
    class ZeroEngine:
        def __init__(self, model, config, *, process_group=None, device=None, record_gradients=False,
                     bucket_elements=1, prefetch=True):
            pass

    return ZeroEngine


#: (area, the defect as a change to a copy of the reference module, capabilities, what the problem line says)
DEFECTS: list[tuple[str, Callable[[types.ModuleType], None], Capabilities, str]] = [
    ("pinning", lambda m: delattr(m, "unpin"), Capabilities(), "pinning.unpin: missing"),
    ("pinning", lambda m: setattr(m, "pin_memory", lambda t, *, make_copy=False, match_shape=True: t),
     Capabilities(), "'make_copy' defaults to False, the contract's to True"),
    ("pinning", lambda m: setattr(m, "is_pinned", lambda tensor: False), Capabilities(),
     "parameter 1 is 'tensor', the contract's is 't'"),
    ("pinning", lambda m: setattr(m, "unpin", lambda t, force: False), Capabilities(),
     "requires 'force', which the contract never passes"),
    ("pinning", lambda m: setattr(m, "pin_empty", lambda shape, dtype=None, device=None: None), Capabilities(),
     "takes no *shape"),
    ("pinning", lambda m: setattr(m, "pin_empty_like", lambda t: t), Capabilities(), "takes no keyword 'dtype'"),
    ("pinning", lambda m: setattr(m, "PinnedStats", type("PinnedStats", (tuple,), {})), Capabilities(),
     "not reference.contract.pinning_rules.PinnedStats (or a subclass)"),
    ("ranges", lambda m: setattr(m, "RangeRegistry", _defective_registry(m)), Capabilities(),
     "class RangeRegistry has no method find"),
    ("ranges", lambda m: setattr(m, "tensor_extent", _NativeLike("tensor_extent(tensor: object) -> tuple")),
     Capabilities(), "parameter 1 is 'tensor', the contract's is 't'"),
    ("ranges", lambda m: setattr(m, "tensor_extent", _NativeLike("Returns the extent.")), Capabilities(),
     "its signature cannot be read"),
    ("io", lambda m: setattr(m, "HEADER_SIZE", "4096"), Capabilities(), "io.HEADER_SIZE: is str"),
    ("accumulation", lambda m: setattr(m, "ZeroEngine", _engine_with_only_init()),
     Capabilities(distributed_engine=True), "ZeroEngine has no method backward"),
    ("accumulation", lambda m: None, Capabilities(distributed_engine=True), "accumulation.ZeroEngine: missing"),
    # without a declared engine the harness cannot run scenarios itself: the module's own run_scenario is required
    ("accumulation", lambda m: delattr(m, "run_scenario"), Capabilities(), "accumulation.run_scenario: missing"),
]


@pytest.mark.parametrize(("area", "defect", "caps", "expected"), DEFECTS,
                         ids=[f"{a}-{e.split(':')[0][:40]}" for a, _, _, e in DEFECTS])
def test_the_interface_check_catches_each_departure(area, defect, caps, expected):
    module = _copy(area)
    assert interface_problems(module, area) == [], "the unchanged copy must conform"
    defect(module)
    problems = interface_problems(module, area, caps)
    assert any(expected in p for p in problems), problems


def test_run_scenario_is_left_to_the_harness_where_an_engine_is_declared():
    """With ``distributed_engine`` the harness runs scenarios on the declared ``ZeroEngine`` itself
    (``conformance.areas.accumulation_engines.scenario_area``), so the module's own ``run_scenario`` is not required;
    the engine is."""
    module = _copy("accumulation")
    del module.run_scenario
    problems = interface_problems(module, "accumulation", Capabilities(distributed_engine=True))
    assert not [p for p in problems if "run_scenario" in p], problems
    assert any("accumulation.ZeroEngine: missing" in p for p in problems), problems


def test_a_call_declared_unsupported_is_not_required():
    module = _copy("pinning")
    del module.pin_empty_like
    assert interface_problems(module, "pinning") == ["pinning.pin_empty_like: missing from copy_of_reference.pinning"]
    assert interface_problems(module, "pinning", unsupported={"pinning.pin_empty_like": "why"}) == []


@pytest.mark.parametrize(
    ("unsupported", "message"),
    [
        ({"io.SwapHandle": "r"}, "with an area it declares (pinning)"),
        ({"pinning": "r"}, "is not in the pinning interface"),
        ({"pinning.pin_empty_lik": "r"}, "is not in the pinning interface; allowed names: PinnedStats"),
        ({"pinning.unpin": " "}, "needs a reason"),
    ],
)
def test_unsupported_declarations_are_checked(unsupported, message):
    with pytest.raises(ValueError, match="unsupported call") as info:
        Implementation("x", "0", {"pinning": "reference.pinning"}, unsupported=unsupported)
    assert message in str(info.value)


def _partial_plugin_env(tmp_path: Path) -> dict[str, str]:
    """PYTHONPATH with a throw-away distribution registering ``selftest-partial`` (as an installed package)."""
    site = tmp_path / "site"
    info = site / "hostoffload_selftest_partial-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostoffload-selftest-partial\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        f"[hostoffload.implementations]\nselftest-partial = {partial_pinning.__name__}:PARTIAL\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_an_unsupported_call_is_skipped_with_its_reason_in_the_run_and_the_report(tmp_path):
    """``selftest-partial`` lacks ``pin_empty_like`` and declares it unsupported: the interface test passes,
    every test marked as exercising the call (by ``requires(calls=...)`` or a ``call`` parameter) is skipped with
    the declared reason, the other cases of the same tests run, and the report lists the reason;
    ``--conformance-list`` shows the declaration."""
    env = _partial_plugin_env(tmp_path)
    listing = run_pytest("--conformance-list", "--conformance-impl", "selftest-partial", env=env, cwd=tmp_path)
    assert f"pinning.pin_empty_like unsupported ({partial_pinning.REASON})" in listing.stdout, listing.stdout
    report = tmp_path / "report"
    proc = run_pytest(
        "--pyargs", "conformance.suite.test_pinning_api", "conformance.suite.test_area_interfaces",
        "-k", "test_area_module_provides or test_pin_empty_and_like or ((test_sparse_tensors_are_refused and coo or "
              "test_bad_arguments_name_the_argument) and torch)",
        "--conformance-impl", "selftest-partial", "--conformance-accelerator", "cpu", "--conformance-profile", "ci",
        "--conformance-report", str(report), "-rs", env=env, cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    reason = f"selftest-partial declares pinning.pin_empty_like unsupported: {partial_pinning.REASON}"
    assert reason in text, text[-4000:]  # the -rs summary
    rows = [r for r in json.loads((report / "report.json").read_text())["matrix"] if r["area"] == "pinning"]
    assert rows and all(r["implementation"] == "selftest-partial" for r in rows), rows
    # test_pin_empty_and_like on 2 backends; on the torch backend pin_empty_like's sparse case (a `call`
    # parameter) and its bad-argument case (a pytest.param mark): 4 skipped.
    assert sum(r["skip_reasons"].get(reason, 0) for r in rows) == 4, rows
    assert sum(r["skipped"] for r in rows) == 4 and sum(r["failed"] + r["errors"] for r in rows) == 0, rows
    # the interface test, the 3 other calls' sparse cases and the 9 other bad-argument cases
    assert sum(r["passed"] for r in rows) == 13, rows
    assert reason in Path(report / "report.md").read_text()


def _documented_locations() -> dict[str, str]:
    """name -> module, from the table between the contract-locations markers of docs/extending.md."""
    root = source_root()
    if root is None or not (root / "docs" / "extending.md").exists():
        pytest.skip("docs/ not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    text = (root / "docs" / "extending.md").read_text()
    table = text[text.index("<!-- contract-locations: begin -->"):text.index("<!-- contract-locations: end -->")]
    out = {}
    for line in table.splitlines():
        match = re.match(r"^\| `([\w.]+)` \| (.*) \|$", line)
        if match:
            for name in re.findall(r"`(\w+)`", match.group(2).split("(also")[0]):
                out[name] = match.group(1)
    return out


def test_contract_types_are_where_extending_md_and_the_changelog_say():
    """Every contract type a plugin author meets (``contract_types()``) is listed in docs/extending.md at the module
    that defines it, and docs/changelog.md names it there (``module.Name``): moving one without updating both,
    i.e. without telling plugin authors, fails here."""
    documented = _documented_locations()
    actual = {name: cls.__module__ for name, cls in contract_types().items()}
    moved = {n: (documented.get(n), m) for n, m in actual.items() if documented.get(n) != m}
    assert not moved, (
        "contract types not where docs/extending.md's table says (name: (table, code)): "
        f"{moved}; update the table and add a docs/changelog.md entry naming the new place"
    )
    unexported = [f"{cls.__module__}.{n}" for n, cls in sorted(contract_types().items())
                  if n not in getattr(importlib.import_module(cls.__module__), "__all__", ())]
    assert not unexported, f"contract types missing from their module's __all__: {unexported}"
    stale = sorted(set(documented) - set(actual))
    assert not stale, f"docs/extending.md lists names that are no contract type (any more): {stale}"
    changelog = (source_root() / "docs" / "changelog.md").read_text()
    unannounced = [f"{m}.{n}" for n, m in sorted(actual.items()) if f"`{m}.{n}`" not in changelog]
    assert not unannounced, f"docs/changelog.md never names these contract types at their place: {unannounced}"

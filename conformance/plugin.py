"""The pytest plugin that turns the suite into a conformance run.

Installed as a ``pytest11`` entry point, so ``pytest --pyargs conformance`` works wherever hostoffload is
installed. It discovers implementations and accelerators, parametrizes every suite test over them, loads the
hypothesis profile, and writes the report.

Suite modules declare their area with ``pytestmark = pytest.mark.conformance_area("pinning")``. A test asks for:

- ``impl``: an :class:`~reference.implementation.Implementation`; skipped (with the reason) where the
  implementation does not provide the module's area, so a partial implementation is never failed for what it
  does not claim.
- ``area_api`` / ``reference_api``: the implementation's module for the area, and the reference's (the oracle).
- ``accelerator``: an available accelerator; ``HOSTOFFLOAD_ACCELERATOR`` is set to it for the test, so everything
  the test calls resolves the same device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from conformance import discovery, profiles
from conformance.accumulation_engines import native_pinning  # noqa: F401 (a fixture the engine tests share)
from conformance.report import ReportCollector, build_report, write_report
from reference.accelerators import ACCELERATOR_ENV, Accelerator
from reference.implementation import Implementation

_COLLECTOR_KEY = pytest.StashKey[ReportCollector]()
_SELECTION_KEY = pytest.StashKey[dict[str, Any]]()
_CELL_KEY = pytest.StashKey[tuple[str, str, str]]()

profiles.register_profiles()

#: Harness parts with options and hooks of their own (crash isolation: conformance.isolation).
pytest_plugins = ["conformance.isolation"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hostoffload-conformance", "hostoffload conformance suite")
    group.addoption(
        "--conformance-impl",
        action="append",
        metavar="NAME[,NAME]",
        help="run only these implementations (entry points of hostoffload.implementations); default: all",
    )
    group.addoption(
        "--conformance-accelerator",
        action="append",
        metavar="NAME[,NAME]",
        help="run only on these accelerators (entry points of hostoffload.accelerators); default: every available",
    )
    group.addoption(
        "--conformance-list",
        action="store_true",
        help="list discovered implementations (with areas) and accelerators (with capabilities), then exit",
    )
    group.addoption(
        "--conformance-report",
        metavar="DIR",
        help="write DIR/report.json and DIR/report.md: area x implementation x accelerator -> outcome",
    )
    group.addoption(
        "--conformance-profile",
        choices=profiles.PROFILES,
        help=f"hypothesis profile (default: ${profiles.PROFILE_ENV}, else 'ci' when $CI is set, else 'dev')",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance_area(name): the conformance area a test belongs to")
    config.addinivalue_line("markers", "gpu: needs a device accelerator")
    config.addinivalue_line("markers", "slow: long-running")
    from hypothesis import settings

    explicit_hypothesis = config.getoption("hypothesis_profile", default=None)
    profile = profiles.choose_profile(config.getoption("conformance_profile"))
    if config.getoption("conformance_profile") or not explicit_hypothesis:
        settings.load_profile(profile)
    else:
        profile = explicit_hypothesis
    impls = discovery.select_implementations(config.getoption("conformance_impl"))
    accs, unavailable = discovery.select_accelerators(config.getoption("conformance_accelerator"))
    config.stash[_SELECTION_KEY] = {
        "profile": profile,
        "implementations": impls,
        "accelerators": accs,
        "unavailable": unavailable,
    }
    config.stash[_COLLECTOR_KEY] = ReportCollector()
    _register_harness_plugins(config)


def _register_harness_plugins(config: pytest.Config) -> None:
    """Harness parts with hooks of their own, kept in their modules: requires(...) at collection
    (conformance.capability_marks) and crash isolation (conformance.isolation)."""
    from conformance import capability_marks

    capability_marks.register(config)
    if not config.pluginmanager.has_plugin("hostoffload-capability-marks"):
        config.pluginmanager.register(_CapabilityMarksPlugin(), "hostoffload-capability-marks")


class _CapabilityMarksPlugin:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        from conformance import capability_marks

        capability_marks.apply(items)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if not config.getoption("conformance_list"):
        return None
    config._do_configure()
    try:
        sel = config.stash[_SELECTION_KEY]
        print("implementations (hostoffload.implementations):")
        for impl in discovery.discover_implementations().values():
            areas = ", ".join(f"{a}{'' if impl.provides(a) else ' (declared, missing)'}" for a in impl.areas)
            print(f"  {impl.name} {impl.version}: areas {areas}; capabilities {impl.capabilities.summary()}")
        print("accelerators (hostoffload.accelerators):")
        from reference.accelerators import discover_accelerators

        for acc in discover_accelerators().values():
            print(f"  {acc.name}: {acc.describe()}")
        print(f"selected: implementations {[i.name for i in sel['implementations']]}, "
              f"accelerators {[a.name for a in sel['accelerators']]}, hypothesis profile {sel['profile']}")
    finally:
        config._ensure_unconfigure()
    return 0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    sel = metafunc.config.stash[_SELECTION_KEY]
    if "impl" in metafunc.fixturenames:
        impls: list[Implementation] = sel["implementations"]
        metafunc.parametrize("impl", impls, ids=[f"impl={i.name}" for i in impls], indirect=True)
    if "accelerator" in metafunc.fixturenames:
        accs: list[Accelerator] = sel["accelerators"]
        metafunc.parametrize("accelerator", accs, ids=[f"acc={a.name}" for a in accs], indirect=True)


def area_of(node: pytest.Item | pytest.FixtureRequest) -> str | None:
    item = node.node if isinstance(node, pytest.FixtureRequest) else node
    marker = item.get_closest_marker("conformance_area")
    return marker.args[0] if marker else None


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> Implementation:
    implementation: Implementation = request.param
    area = area_of(request)
    if area is not None and not implementation.provides(area):
        declared = "declared but its module is missing" if area in implementation.areas else "not declared"
        pytest.skip(f"{implementation.name} does not provide area '{area}' ({declared})")
    return implementation


@pytest.fixture
def accelerator(request: pytest.FixtureRequest) -> Iterator[Accelerator]:
    acc: Accelerator = request.param
    old = os.environ.get(ACCELERATOR_ENV)
    os.environ[ACCELERATOR_ENV] = acc.name
    try:
        yield acc
    finally:
        if old is None:
            os.environ.pop(ACCELERATOR_ENV, None)
        else:
            os.environ[ACCELERATOR_ENV] = old


@pytest.fixture
def area_api(impl: Implementation, request: pytest.FixtureRequest) -> ModuleType:
    area = area_of(request)
    if area is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses area_api but its module sets no conformance_area mark")
    return impl.load(area)


@pytest.fixture
def reference_api(request: pytest.FixtureRequest) -> ModuleType:
    """The reference implementation's module for this test's area: the oracle every implementation meets."""
    import reference

    area = area_of(request)
    if area is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses reference_api but sets no conformance_area mark")
    return reference.IMPLEMENTATION.load(area)


@pytest.fixture
def conformance_property(request: pytest.FixtureRequest):
    """``conformance_property(name, n)`` adds ``n`` to a counter shown in the report (e.g. state-machine steps)."""
    collector = request.config.stash[_COLLECTOR_KEY]
    return collector.add_property


# -- report -------------------------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        area = area_of(item) or "harness"
        params = getattr(getattr(item, "callspec", None), "params", {})
        impl_obj = params.get("impl")
        acc_obj = params.get("accelerator")
        item.stash[_CELL_KEY] = (
            area,
            impl_obj.name if impl_obj is not None else "-",
            acc_obj.name if acc_obj is not None else "-",
        )



@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    rep = yield
    record_report(item, rep)
    return rep


def record_report(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Count ``rep`` in the report matrix (also called for reports replayed from an isolated child)."""
    key = item.stash.get(_CELL_KEY, None)
    if key is not None:
        collector = item.config.stash[_COLLECTOR_KEY]
        if rep.when == "call" or (rep.when == "setup" and not rep.passed) or (rep.when == "teardown" and rep.failed):
            outcome = "failed" if rep.failed else rep.outcome
            reason = None
            if rep.skipped and isinstance(rep.longrepr, tuple):
                reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
            collector.record(key, outcome, item.nodeid, reason)


def _meta(config: pytest.Config) -> dict[str, Any]:
    sel = config.stash[_SELECTION_KEY]
    return {
        "profile": sel["profile"],
        "implementations": [i.name for i in sel["implementations"]],
        "accelerators": [a.name for a in sel["accelerators"]],
        "unavailable_accelerators": [a.name for a in sel["unavailable"]],
        "accelerator_capabilities": {a.name: a.describe() for a in sel["accelerators"]},
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("conformance_report")
    if not path or _SELECTION_KEY not in session.config.stash:
        return
    report = build_report(session.config.stash[_COLLECTOR_KEY], _meta(session.config))
    json_path, md_path = write_report(path, report)
    session.config.stash[_REPORT_PATHS_KEY] = (json_path, md_path)


_REPORT_PATHS_KEY = pytest.StashKey[tuple[Any, Any]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _SELECTION_KEY not in config.stash:
        return
    sel = config.stash[_SELECTION_KEY]
    terminalreporter.section("hostoffload conformance")
    terminalreporter.write_line(
        f"implementations: {', '.join(i.name for i in sel['implementations'])}; "
        f"accelerators: {', '.join(a.name for a in sel['accelerators'])}"
        + (f" (not available: {', '.join(a.name for a in sel['unavailable'])})" if sel["unavailable"] else "")
        + f"; hypothesis profile: {sel['profile']}"
    )
    for name, value in config.stash[_COLLECTOR_KEY].properties.items():
        terminalreporter.write_line(f"{name}: {value}")
    paths = config.stash.get(_REPORT_PATHS_KEY, None)
    if paths:
        terminalreporter.write_line(f"conformance report: {paths[0]} and {paths[1]}")

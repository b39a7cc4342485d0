"""The pytest plugin that turns a session into a conformance run.

:mod:`conformance.activation` (the ``pytest11`` entry point) registers this module only when the session asks for
the suite, so nothing here touches an unrelated project's session. It validates the selection before any test
runs, discovers implementations and accelerators, parametrizes every suite test over them, loads the hypothesis
profile, and writes the report.

Suite modules declare their area with ``pytestmark = pytest.mark.conformance_area("pinning")``. A test asks for:

- ``impl``: an :class:`~reference.contract.implementation.Implementation`; skipped (with the reason) where the
  implementation does not provide the module's area, so a partial implementation is never failed for what it
  does not claim.
- ``area_api`` / ``reference_api``: the implementation's module for the area, and the reference's (the oracle).
- ``accelerator``: an available accelerator; ``HOSTOFFLOAD_ACCELERATOR`` is set to it for the test, so everything
  the test calls resolves the same device.
"""

from __future__ import annotations

import gc
import os
import random
import shlex
import time
from collections.abc import Generator, Iterator
from types import ModuleType
from typing import Any

import pytest

from conformance.areas.accumulation_engines import (
    native_pinning,  # noqa: F401 (a fixture the engine tests share)
    scenario_area,
)
from conformance.harness import discovery, option_checks, profiles, rule_ledger
from conformance.harness.expectations import SKIP_PREFIX, Expectations, expectation_id
from conformance.harness.report import XPASS_STRICT, ReportCollector, build_report, totals_line, write_report
from reference.contract.accelerators import Accelerator
from reference.contract.envvars import ACCELERATOR_ENV
from reference.contract.errors import ConfigurationError
from reference.contract.implementation import Implementation

_COLLECTOR_KEY = pytest.StashKey[ReportCollector]()
_SELECTION_KEY = pytest.StashKey[dict[str, Any]]()
_CELL_KEY = pytest.StashKey[tuple[str, str, str]]()
_RULES_KEY = pytest.StashKey[tuple[str, ...]]()
_EXPECTATIONS_KEY = pytest.StashKey[Expectations]()
_RULE_SET_KEY = pytest.StashKey[dict[str, Any]]()

#: Harness parts with hooks of their own (crash isolation: conformance.harness.isolation; its option lives in
#: conformance.activation with the others, so it exists before the command line is parsed).
pytest_plugins = ["conformance.harness.isolation"]

_RUN_KEY = pytest.StashKey[dict[str, Any]]()
_REPORT_PATHS_KEY = pytest.StashKey[tuple[Any, Any]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance_area(name): the conformance area a test belongs to")
    config.addinivalue_line("markers", "gpu: needs a device accelerator")
    config.addinivalue_line("markers", "slow: long-running; skipped by the ci profile")
    try:
        profile = _configure_profile(config)
        seed = _configure_seed(config, profile)
        selection = _select(config)
        _check_report_option(config)
        config.stash[_EXPECTATIONS_KEY] = Expectations.from_options(config)
    except ConfigurationError as exc:
        # A usage error: pytest prints the one line and exits with status 4, before collecting anything.
        raise pytest.UsageError(str(exc)) from None
    config.stash[_SELECTION_KEY] = {**selection, "profile": profile, "seed": seed}
    config.stash[_COLLECTOR_KEY] = ReportCollector()
    config.stash[_RULE_SET_KEY] = _rule_set()
    _register_harness_plugins(config)


def _rule_set() -> dict[str, Any]:
    """The suite's version and the rules it judges, for the report's header: what a vendor pins."""
    rules, source = rule_ledger.rule_set()
    prefixes = sorted({r.rstrip("0123456789") for r in rules}, key=len, reverse=True)
    return {"version": _suite_version(), "digest": rule_ledger.suite_digest(), "rule_set": rules,
            "rule_set_compact": rule_ledger.compact(rules), "rules_source": source, "prefixes": prefixes}


def _suite_version() -> str:
    """The version of the suite this run imported: its source tree's pyproject.toml where it runs from one (an
    installed distribution of another version may sit beside it), else the installed distribution's."""
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if found:
            return f"{found.group(1)} (source tree {pyproject.parent})"
    try:
        from importlib.metadata import version

        return version("hostoffload")
    except Exception:  # the report must never fail the run
        return "unknown"


def _register_harness_plugins(config: pytest.Config) -> None:
    """Harness parts with hooks of their own, kept in their modules: requires(...) at collection
    (conformance.harness.capability_marks) and crash isolation (conformance.harness.isolation)."""
    from conformance.harness import capability_marks

    capability_marks.register(config)
    if not config.pluginmanager.has_plugin("hostoffload-capability-marks"):
        config.pluginmanager.register(_CollectionMarksPlugin(config), "hostoffload-capability-marks")


class _CollectionMarksPlugin:
    """Marks added once collection (and ``-k`` deselection) is done: ``requires(...)`` skips, then the vendor's
    xfails and skips files (conformance.harness.expectations), so an entry is matched against the tests that will
    run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        from conformance.harness import capability_marks

        capability_marks.apply(items)
        self.config.stash[_EXPECTATIONS_KEY].apply(items)


def _configure_profile(config: pytest.Config) -> str:
    """Register and load the conformance profile; an explicit ``--hypothesis-profile`` alone wins."""
    profiles.register_profiles()
    explicit_hypothesis = config.getoption("hypothesis_profile", default=None)
    profile = profiles.choose_profile(config.getoption("conformance_profile"))
    if config.getoption("conformance_profile") or not explicit_hypothesis:
        profiles.load_profile(profile)
        return profile
    return explicit_hypothesis


def _configure_seed(config: pytest.Config, profile: str) -> int | str | None:
    """The hypothesis seed of the run: None where the profile is derandomized, else given or drawn now.

    Drawing it here (and handing it to hypothesis as ``--hypothesis-seed`` would) makes a random run reproducible
    from its report: the seed is printed with every failure's rerun command.
    """
    from hypothesis import settings

    given = config.getoption("hypothesis_seed", default=None)
    if given is not None:
        return int(given) if str(given).isdigit() else given
    assert settings.default is not None  # hypothesis always has a loaded profile
    if settings.default.derandomize:
        return None
    seed = random.SystemRandom().randrange(2**32)
    config.option.hypothesis_seed = str(seed)
    return seed


def _select(config: pytest.Config) -> dict[str, Any]:
    """Implementations and accelerators to run; ConfigurationError names the option and the allowed values."""
    try:
        impls = discovery.select_implementations(config.getoption("conformance_impl"))
        accs, unavailable = discovery.select_accelerators(config.getoption("conformance_accelerator"))
    except TypeError as exc:  # a broken entry point of an installed package
        raise ConfigurationError(f"a hostoffload plugin is broken: {exc}") from None
    if config.getoption("conformance_accelerator") and unavailable:
        names = ", ".join(a.name for a in unavailable)
        available = ", ".join(a.name for a in discovery.discover_available_accelerators()) or "none"
        raise ConfigurationError(
            f"--conformance-accelerator names accelerator(s) not available on this machine: {names}; "
            f"available here: {available}"
        )
    return {"implementations": impls, "accelerators": accs, "unavailable": unavailable}


def _check_report_option(config: pytest.Config) -> None:
    option_checks.check_report_option(config.getoption("conformance_report"))


def print_discovered(config: pytest.Config) -> None:
    """``--conformance-list``: what is installed, what this run would select."""
    sel = config.stash[_SELECTION_KEY]
    print("implementations (hostoffload.implementations):")
    for impl in discovery.discover_implementations().values():
        areas = ", ".join(f"{a}{'' if impl.provides(a) else ' (declared, missing)'}" for a in impl.areas)
        unsupported = "".join(f"; {call} unsupported ({why})" for call, why in impl.unsupported.items())
        print(f"  {impl.name} {impl.version}: areas {areas}; capabilities {impl.capabilities.summary()}{unsupported}")
    print("accelerators (hostoffload.accelerators):")
    from reference.contract.accelerators import discover_accelerators

    for acc in discover_accelerators().values():
        print(f"  {acc.name}: {acc.describe()}")
    print(f"selected: implementations {[i.name for i in sel['implementations']]}, "
          f"accelerators {[a.name for a in sel['accelerators']]}, hypothesis profile {sel['profile']}")


def selected_implementations(config: pytest.Config) -> list[Implementation]:
    """The implementations this run judges (for a suite module that parametrizes over what they declare)."""
    return list(config.stash[_SELECTION_KEY]["implementations"])


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
    module = impl.load(area)
    return scenario_area(impl, module) if area == "accumulation" else module


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


# -- which cell each test counts in, and what the ci profile leaves out ------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _assign_cells(items)
    _skip_slow_tests(config, items)


def _assign_cells(items: list[pytest.Item]) -> None:
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


def _skip_slow_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    profile = config.stash[_SELECTION_KEY]["profile"]
    if profile not in profiles.SKIPS_SLOW:
        return
    skip = pytest.mark.skip(reason=f"slow: left out by the {profile} profile (any other profile runs it)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (torch, hypothesis, every collected test: hundreds of thousands of
    objects) out of the garbage collector. The suite's leak and lifetime checks call ``gc.collect()`` before they
    observe, hundreds of times a run, and each call walked all of it (about half the CPU time of the pinning
    tests). What they must collect is garbage the tests create, which is never frozen; what is frozen was
    alive at the end of collection, after one full collection. Unfrozen again at the end of the session."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Freeze again before each test (before its fixtures exist): what is alive between two tests, after a full
    collection, is the session's (modules, caches, the collected items), never garbage the next test makes.

    Without it, the first test that reaches a lazily imported part of torch (``FakeTensorMode`` pulls in
    torch._dynamo, sympy and torch.distributed: 800 modules, 120 000 objects) made every later ``gc.collect()``
    walk all of it again: 70 ms per call, two thirds of the pinning API tests' time. The suite has no fixture
    wider than a function, so nothing frozen here is a value a later test drops and expects collected."""
    gc.collect()
    gc.freeze()


# -- the report ---------------------------------------------------------------------------------------------------
def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_RUN_KEY] = {"start": time.monotonic()}


def _outcome(rep: pytest.TestReport) -> str | None:
    """What this phase's report counts as in the matrix (None: nothing, e.g. a passing setup)."""
    if hasattr(rep, "wasxfail"):
        return "xfailed" if rep.skipped else "xpassed" if rep.passed else "failed"
    if rep.when == "call":
        if rep.failed and isinstance(rep.longrepr, str) and rep.longrepr.startswith(XPASS_STRICT):
            return "xpassed_strict"
        return rep.outcome
    if rep.failed:
        return "errors"
    if rep.when == "setup" and rep.skipped:
        reason = _skip_reason(rep)
        return "skipped_by_file" if reason and reason.startswith(SKIP_PREFIX) else "skipped"
    return None


def _skip_reason(rep: pytest.TestReport) -> str | None:
    if isinstance(rep.longrepr, tuple):
        return str(rep.longrepr[2]).removeprefix("Skipped: ")
    return None


def _failure_message(rep: pytest.TestReport) -> str:
    crash = getattr(rep.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    return str(rep.longrepr or "")


def reproduce_command(item: pytest.Item, config: pytest.Config) -> str:
    """A command that reruns just this test, as this run ran it (profile, seed, implementation, accelerator)."""
    sel = config.stash[_SELECTION_KEY]
    _area, impl_name, acc_name = item.stash.get(_CELL_KEY, ("", "-", "-"))
    module = getattr(getattr(item, "module", None), "__name__", None)
    target = ["--pyargs", module] if module else [item.nodeid.split("::", 1)[0]]
    args = ["python", "-m", "pytest", *target, "-p", "no:cacheprovider"]
    if sel["profile"] in profiles.PROFILES:
        args += ["--conformance-profile", sel["profile"]]
    else:
        args += ["--hypothesis-profile", sel["profile"]]
    if impl_name != "-":
        args += ["--conformance-impl", impl_name]
    if acc_name != "-":
        args += ["--conformance-accelerator", acc_name]
    args += ["-k", getattr(item, "originalname", None) or item.name]
    if sel["seed"] is not None:
        args.append(f"--hypothesis-seed={sel['seed']}")
    return shlex.join(args)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    record_report(item, rep)
    return rep


def record_report(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Count ``rep`` in the report matrix (also called for reports replayed from an isolated child)."""
    key = item.stash.get(_CELL_KEY, None)
    outcome = _outcome(rep) if key is not None else None
    if key is not None and outcome is not None:
        reason = _skip_reason(rep) if outcome in ("skipped", "skipped_by_file") else None
        failing = outcome in ("failed", "errors", "xpassed_strict")
        item.config.stash[_COLLECTOR_KEY].record(
            key,
            outcome,
            item.nodeid,
            reason,
            when=rep.when,
            message=_failure_message(rep) if failing else "",
            reproduce=reproduce_command(item, item.config) if failing else "",
            rules=_rules(item),
            test_id=expectation_id(item) if failing else "",
        )


def _rules(item: pytest.Item) -> tuple[str, ...]:
    """The rules ``item`` judges (cited by its name or docstring), read once per test."""
    if _RULES_KEY not in item.stash:
        prefixes = item.config.stash[_RULE_SET_KEY]["prefixes"] if _RULE_SET_KEY in item.config.stash else ()
        item.stash[_RULES_KEY] = rule_ledger.rules_of(item, prefixes)
    return item.stash[_RULES_KEY]


def _meta(session: pytest.Session, exitstatus: int) -> dict[str, Any]:
    config = session.config
    sel = config.stash[_SELECTION_KEY]
    start = config.stash.get(_RUN_KEY, {}).get("start", time.monotonic())
    return {
        "command": shlex.join(["pytest", *config.invocation_params.args]),
        "working_directory": str(config.invocation_params.dir),
        "profile": sel["profile"],
        "seed": sel["seed"],
        "duration_s": round(time.monotonic() - start, 1),
        "exit_status": int(exitstatus),
        "implementations": [i.name for i in sel["implementations"]],
        "accelerators": [a.name for a in sel["accelerators"]],
        "unavailable_accelerators": [a.name for a in sel["unavailable"]],
        "accelerator_capabilities": {a.name: a.describe() for a in sel["accelerators"]},
        "suite": {k: v for k, v in config.stash[_RULE_SET_KEY].items() if k != "prefixes"},
        "expectations": config.stash[_EXPECTATIONS_KEY].summary(),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _SELECTION_KEY not in config.stash or config.getoption("collectonly", default=False):
        return
    report = build_report(config.stash[_COLLECTOR_KEY], _meta(session, exitstatus))
    config.stash[_RUN_KEY]["report"] = report
    path = config.getoption("conformance_report")
    if not path:
        return
    try:
        config.stash[_REPORT_PATHS_KEY] = write_report(path, report)
    except OSError as exc:  # checked writable at configure; the disk can still fill up or vanish
        config.stash[_RUN_KEY]["report_error"] = f"could not write the conformance report to {path}: {exc}"
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


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
        + (f"; seed: {sel['seed']}" if sel["seed"] is not None else "")
    )
    for name, value in config.stash[_COLLECTOR_KEY].properties.items():
        terminalreporter.write_line(f"{name}: {value}")
    for warning in config.stash[_EXPECTATIONS_KEY].warnings():
        terminalreporter.write_line(f"warning: {warning}", yellow=True)
    missing: dict[str, dict[str, list[str]]] = config.stash[_COLLECTOR_KEY].ledger.summary()["missing_packages"]  # type: ignore[assignment]  # summary() is a report of mixed values
    for package, entry in missing.items():
        left = entry["rules_not_judged"] + entry["rules_partly_judged"]
        terminalreporter.write_line(f"not judged: optional package {package} is missing ({entry['tests']} tests; "
                                    f"rules {', '.join(left) or 'none cited'})", yellow=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The verdict and the report paths, after pytest's own summary: the last lines a reader sees."""
    gc.unfreeze()
    run = config.stash.get(_RUN_KEY, {})
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if "report" not in run or reporter is None:
        return
    report = run["report"]
    colour = {"passed": {"green": True}, "failed": {"red": True}}.get(report["verdict"], {"yellow": True})
    reporter.write_line(
        f"hostoffload conformance: {report['verdict'].upper()} ({totals_line(report)})", bold=True, **colour
    )
    if "report_error" in run:
        reporter.write_line(run["report_error"], red=True)
    paths = config.stash.get(_REPORT_PATHS_KEY, None)
    if paths:
        reporter.write_line(f"conformance report: {paths[1]} and {paths[0]}")

"""Crash isolation is invisible to pytest: a run whose tests go to child processes reports exactly what the same
run in one process reports -- the junit XML, the ``-rA`` summary, the outcome line and the conformance report --
and the parent's fixtures of module and session scope are set up and torn down as often as in-process, whatever
the mix of isolated and in-process tests.

A small suite written here is run three times: in-process (``--conformance-isolation off``), with its ``isolated``
tests in children forked from the run itself (single-threaded run: OpenBLAS held to one thread), and in children
of the zygote (the default once torch has started its threads). Every outcome pytest knows is in it: pass, fail,
error in setup and in teardown, a skip from a mark and one from inside the test, xfail, xpass, a user property,
and a module fixture of the run whose teardown fails after the module's last test, an isolated one.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")

_CONFTEST = '''
import os
import pytest

def _log(event, name):
    with open(os.environ["FIXTURE_LOG"], "a") as f:
        f.write(f"{os.getpid()} {event} {name}\\n")

@pytest.fixture(scope="session")
def session_resource():
    _log("setup", "session")
    yield "session"
    _log("teardown", "session")
'''

_MODULE_A = '''
import os
import pytest

@pytest.fixture(scope="module")
def module_a(session_resource):
    from conftest import _log
    _log("setup", "module_a")
    yield "a"
    _log("teardown", "module_a")

@pytest.fixture
def breaks_in_teardown():
    yield
    raise RuntimeError("teardown broke on purpose")

@pytest.fixture
def breaks_in_setup():
    raise RuntimeError("setup broke on purpose")

def test_a_in_process_first(module_a):
    print("output of the first test")

@pytest.mark.isolated
def test_a_isolated_passes(module_a, record_property):
    import time
    from conftest import _log
    _log("ppid", str(os.getppid()))
    record_property("answer", 42)
    print("output of an isolated test")
    time.sleep(0.3)

@pytest.mark.isolated
def test_a_isolated_fails(module_a):
    assert 1 + 1 == 3, "arithmetic on purpose"

@pytest.mark.isolated
def test_a_isolated_skips_inside():
    pytest.skip("skipped from inside the isolated test")

@pytest.mark.isolated
@pytest.mark.skip(reason="skipped by its mark")
def test_a_isolated_skip_mark():
    pass

@pytest.mark.isolated
@pytest.mark.xfail(reason="known to fail")
def test_a_isolated_xfails():
    assert False

@pytest.mark.isolated
@pytest.mark.xfail(reason="known to fail, but passes")
def test_a_isolated_xpasses():
    pass

@pytest.mark.isolated
def test_a_isolated_errors_in_setup(breaks_in_setup):
    pass

@pytest.mark.isolated
def test_a_isolated_errors_in_teardown(module_a, breaks_in_teardown):
    pass
'''

_MODULE_B = '''
import pytest

@pytest.fixture(scope="module")
def module_b(session_resource):
    from conftest import _log
    _log("setup", "module_b")
    yield "b"
    _log("teardown", "module_b")

def test_b_in_process_after_isolated_ones(module_b):
    pass

@pytest.mark.isolated
def test_b_isolated_between(module_b):
    pass

def test_b_in_process_again(module_b):
    pytest.skip("skipped in process")
'''

_MODULE_C = '''
import pytest

@pytest.fixture(scope="module")
def breaks_at_module_end():
    yield
    raise RuntimeError("module teardown broke on purpose")

def test_c_in_process_first(breaks_at_module_end):
    pass

@pytest.mark.isolated
def test_c_isolated_last(session_resource):
    pass
'''

_MODES = {
    "in-process": ("--conformance-isolation", "off"),
    "forked": ("--conformance-isolation", "auto"),
    "zygote": ("--conformance-isolation", "auto"),
}


def _suite(root: Path) -> None:
    (root / "conftest.py").write_text(_CONFTEST)
    (root / "test_mix_a.py").write_text(_MODULE_A)
    (root / "test_mix_b.py").write_text(_MODULE_B)
    (root / "test_mix_c.py").write_text(_MODULE_C)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each mode's (process, xml root, report data, fixture log lines, parent pid)."""
    out = {}
    for mode, isolation in _MODES.items():
        root = tmp_path_factory.mktemp(mode)
        _suite(root)
        log = root / "fixtures.log"
        env = {"FIXTURE_LOG": str(log), "PYTHONPATH": None}
        if mode == "forked":
            env |= {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        proc = run_pytest(
            ".", "-rA", "--junitxml", str(root / "out.xml"), "--conformance-report", str(root / "report"),
            "--conformance-impl", "reference", "--conformance-accelerator", "cpu", "--conformance-profile", "ci",
            *isolation, env=_with_source_path(env), cwd=root, timeout=300,
        )
        out[mode] = {
            "root": str(root),
            "proc": proc,
            "xml": ET.parse(root / "out.xml").getroot() if (root / "out.xml").exists() else None,
            "report": json.loads((root / "report" / "report.json").read_text())
            if (root / "report" / "report.json").exists() else None,
            "log": log.read_text().splitlines() if log.exists() else [],
        }
    return out


def _with_source_path(env: dict) -> dict:
    """Keep PYTHONPATH (the checkout under test) but put the suite's directory first, for ``import conftest``."""
    import os

    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))
    return env


def _testcases(run: dict) -> dict[str, list[tuple]]:
    """Each test case's outcome elements (tag, type, message, text) and properties: everything but timings and
    the run's directory."""
    xml, out = run["xml"], {}
    for case in xml.iter("testcase"):
        children = []
        for child in case:
            if child.tag == "properties":
                children.append(("properties", tuple((p.get("name"), p.get("value")) for p in child)))
            else:
                text = (child.text or "").strip().replace(run["root"], "ROOT")
                children.append((child.tag, child.get("type"), child.get("message"), text))
        out[_case_name(case)] = children
    return out


def _case_name(case: ET.Element) -> str:
    return f"{case.get('classname')}::{case.get('name')}"


def _suite_counts(xml: ET.Element) -> dict[str, str | None]:
    suite = xml if xml.tag == "testsuite" else xml.find("testsuite")
    return {k: suite.get(k) for k in ("tests", "errors", "failures", "skipped")}


def _summary(stdout: str) -> list[str]:
    """The ``-rA`` lines ("short test summary info") and the final outcome line, without the duration."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    section = [line for line in lines[start + 1 :] if re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ", line)]
    outcome = next(line for line in reversed(lines) if re.match(r"^=+ .* in [\d.]+s", line))
    return [*section, re.sub(r" in [\d.]+s.*", "", outcome)]


def _passes_section(stdout: str) -> str:
    """The ``-rA`` PASSES section: each passed test's captured output."""
    return re.split(r"\n=+ [^=\n]+ =+\n", stdout.split("= PASSES =", 1)[1])[0]


def _report_cells(report: dict) -> list[tuple]:
    keys = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "skip_reasons", "status")
    return sorted(
        (r["area"], r["implementation"], r["accelerator"], *(json.dumps(r[k], sort_keys=True) for k in keys))
        for r in report["matrix"]
    )


@pytest.mark.parametrize("mode", ["forked", "zygote"])
def test_an_isolated_run_reports_what_an_in_process_run_does(runs, mode):
    base, iso = runs["in-process"], runs[mode]
    text = iso["proc"].stdout + iso["proc"].stderr
    assert "INTERNALERROR" not in text and iso["proc"].returncode == 1, text[-4000:]
    assert base["proc"].returncode == 1, base["proc"].stdout[-4000:]
    assert _testcases(iso) == _testcases(base)
    assert _suite_counts(iso["xml"]) == _suite_counts(base["xml"]) == {
        "tests": "14", "errors": "3", "failures": "1", "skipped": "4"
    }
    assert _summary(iso["proc"].stdout) == _summary(base["proc"].stdout)
    assert _passes_section(iso["proc"].stdout) == _passes_section(base["proc"].stdout)
    assert "output of an isolated test" in _passes_section(iso["proc"].stdout)
    durations = {_case_name(c): float(c.get("time")) for c in iso["xml"].iter("testcase")}
    assert durations["test_mix_a::test_a_isolated_passes"] >= 0.3, durations
    assert _report_cells(iso["report"]) == _report_cells(base["report"])
    reasons = {r for row in iso["report"]["matrix"] for r in row["skip_reasons"]}
    assert {"skipped from inside the isolated test", "skipped by its mark", "skipped in process"} <= reasons


@pytest.mark.parametrize("mode", ["in-process", "forked", "zygote"])
def test_every_fixture_instance_is_torn_down_once_in_the_process_that_made_it(runs, mode):
    """No 'previous item was not torn down properly' after isolated tests; a forked child finalizes only what it
    set up (never the parent's module or session fixtures); the parent finalizes its own, once each."""
    run = runs[mode]
    assert "was not torn down properly" not in run["proc"].stdout, run["proc"].stdout[-4000:]
    events = [line.split(" ", 2) for line in run["log"]]
    balance: Counter = Counter()
    for pid, event, name in events:
        if event in ("setup", "teardown"):
            balance[(pid, name)] += 1 if event == "setup" else -1
            assert balance[(pid, name)] in (0, 1), f"{event} of {name} in {pid} out of order: {run['log']}"
    assert all(v == 0 for v in balance.values()), run["log"]
    parent = events[0][0]  # the first test runs in process and sets up the session fixture
    in_parent = Counter(name for pid, event, name in events if pid == parent and event == "setup")
    assert in_parent == Counter({"session": 1, "module_a": 1, "module_b": 1}), run["log"]
    (child_ppid,) = [name for _pid, event, name in events if event == "ppid"]
    if mode == "forked":
        assert child_ppid == parent, "the direct-fork path was not taken"
    elif mode == "zygote":
        assert child_ppid != parent, "the zygote path was not taken"

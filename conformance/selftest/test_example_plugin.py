"""Item 4 and docs/extending.md's flow: install the example plugin, run the whole suite on it, green with its
expected-failure file; and that file's mechanics end to end (issue 42 item 3: strict XPASS, skips, prefixes).

The plugin is installed with pip into a folder put on PYTHONPATH (the environment's site-packages stays as it
was, so parallel runs are not disturbed); the child runs see it exactly like an installed distribution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance.selftest.runner import run_pytest, run_python, source_root
from reference.contract.accelerators import Accelerator, default_accelerator, discover_accelerators
from reference.contract.accelerators.cpu import CpuAccelerator

pytestmark = pytest.mark.conformance_area("harness")


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> dict[str, str]:
    root = source_root()
    if root is None:
        pytest.skip("the example plugin ships in the source tree; set HOSTOFFLOAD_SOURCE_ROOT to a checkout")
    target = tmp_path_factory.mktemp("example-site")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
         str(target), str(root / "examples" / "hostoffload-example-plugin")],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


EXAMPLE_AREAS = ("pinning", "ranges", "optimizer_kernels")
KERNEL_TESTS = "conformance/suite/test_optimizer_kernels.py"
#: The example kernel's known gap (hostoffload_example/kernels.py), the one test its xfails file lists.
KNOWN_FAILURE = (f"{KERNEL_TESTS}::test_R16_declared_kernel_rejects_bad_arguments"
                 "[kernel=torch-optim-adam-impl=example-acc=example-host-size]")
PASSING = KNOWN_FAILURE.replace("-size]", "-dtype]")
#: The R29 tests of the area (one drawn, two sizes of special values, three refused moment pairs): the example's
#: kernel keeps fp32 moments, so each is skipped for it, saying R29 is not judged.
R29_TESTS = 6


def test_whole_suite_is_green_on_the_example(example_env, tmp_path):
    """Every suite module, on the example implementation and its accelerator, with the example's expected-failure
    file as a vendor's CI passes it: what it declares passes, its one known gap counts as an expected failure, the
    rest is skipped as not declared, and nothing fails."""
    report = tmp_path / "report"
    xfails = source_root() / "examples" / "hostoffload-example-plugin" / "conformance-xfails.txt"
    proc = run_pytest(
        "--pyargs", "conformance.suite",
        "--conformance-impl", "example",
        "--conformance-accelerator", "example-host",
        "--conformance-profile", "ci",
        "--conformance-report", str(report),
        "--conformance-xfails", str(xfails),
        # Every test that involves the example's implementation or accelerator (their ids name it); tests of the
        # reference alone (no impl, no accelerator parameter) say nothing about the example and are left out, and
        # so is the one whose name says "example" for another reason (examples/train_gpt.py --help, no plugin).
        "-k", "example and not test_example_help_shows_every_default",
        "-q",
        env=example_env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["verdict"] == "passed", data["totals"]
    assert data["totals"]["xfailed"] == 1 and data["totals"]["xpassed"] == 0, data["totals"]
    assert data["expectations"]["xfails"]["unmatched"] == [], data["expectations"]
    assert data["implementations"] == ["example"] and data["accelerators"] == ["example-host"]
    cells = {(r["area"], r["implementation"], r["accelerator"]): r for r in data["matrix"]}
    for area in ("pinning", "ranges"):  # the areas the example declares
        assert cells[(area, "example", "example-host")]["status"] == "passed", cells
        assert cells[(area, "example", "-")]["status"] == "passed", cells
    kernels = cells[("optimizer_kernels", "example", "example-host")]
    assert kernels["status"] == "passed" and kernels["xfailed"] == 1 and kernels["passed"] >= 5, kernels
    for (area, impl, _acc), row in cells.items():
        if impl == "example" and area not in EXAMPLE_AREAS:
            undeclared = all("not declared" in r or "does not declare" in r for r in row["skip_reasons"])
            assert row["status"] == "skipped" and undeclared, row


def _kernel_run(example_env, tmp_path, *options: str):
    """The optimizer-kernel tests on the example, with ``options`` (the files), as a vendor's CI runs them."""
    report = tmp_path / "report"
    proc = run_pytest(
        "--pyargs", "conformance.suite.test_optimizer_kernels", "--conformance-impl", "example",
        "--conformance-accelerator", "example-host", "--conformance-profile", "ci",
        "--conformance-report", str(report), *options, "-q", env=example_env, cwd=tmp_path,
    )
    data = json.loads((report / "report.json").read_text())
    return proc, data, (report / "report.md").read_text()


def test_xfails_file_counts_the_known_failure_and_a_listed_pass_fails_the_run(example_env, tmp_path):
    """Strict: the known failure listed -> xfailed; a passing test listed too -> XPASS, which fails the run (exit
    status, verdict, the cell, a failure entry saying why); --conformance-xfails-nonstrict reports the XPASS and
    the run passes. Comments and blank lines are ignored."""
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(f"# the known gap\n{KNOWN_FAILURE}  # trailing comment\n\n{PASSING}\n")
    proc, data, md = _kernel_run(example_env, tmp_path, "--conformance-xfails", str(xfails))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    t = data["totals"]
    assert (t["xfailed"], t["xpassed_strict"], t["failed"], t["xpassed"]) == (1, 1, 0, 0), t
    assert data["verdict"] == "failed" and data["expectations"]["strict"] is True, data["expectations"]
    (cell,) = [r for r in data["matrix"] if r["implementation"] == "example"]
    assert cell["status"] == "failed" and [f["nodeid"].endswith("-dtype]") for f in cell["failures"]] == [True], cell
    assert "listed as an expected failure, but passed" in md, md

    proc, data, md = _kernel_run(example_env, tmp_path, "--conformance-xfails", str(xfails),
                                 "--conformance-xfails-nonstrict")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    t = data["totals"]
    assert (t["xfailed"], t["xpassed"], t["xpassed_strict"], data["verdict"]) == (1, 1, 0, "passed"), t
    assert "non-strict" in md, md


def test_skips_file_id_prefixes_and_the_known_failure_without_xfails(example_env, tmp_path):
    """Without an xfails file the example's known gap is a real failure, reported under the very id its xfails file
    lists. A skips entry ending where a part of the id ends lists the test with all its parameters (skipped, and
    counted apart from other skips); one that ends inside a test's name lists nothing (those tests run) and is
    warned about at the top of the report, as is an entry for no test at all."""
    skips = tmp_path / "skips.txt"
    drawn = f"{KERNEL_TESTS}::test_R16_declared_kernel_meets_the_reference_as_it_claims"
    inside_a_name = f"{KERNEL_TESTS}::test_R16_declared_kernel_rejects"
    skips.write_text(f"{drawn}\n\n# no such test\n{inside_a_name}\nconformance/suite/test_gone.py\n")
    proc, data, md = _kernel_run(example_env, tmp_path, "--conformance-skips", str(skips))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    t = data["totals"]
    # Skipped: the six R29 tests (bf16 moments), which the example's kernel does not declare, with that reason.
    assert (t["skipped_by_file"], t["passed"], t["failed"], t["skipped"]) == (1, 4, 1, R29_TESTS), t
    (cell,) = [r for r in data["matrix"] if r["implementation"] == "example"]
    assert any("R29 (bf16 moments) is not judged" in r for r in cell["skip_reasons"]), cell["skip_reasons"]
    assert [f["id"] for f in cell["failures"]] == [KNOWN_FAILURE], cell["failures"]
    unmatched = data["expectations"]["skips"]["unmatched"]
    assert [u.rsplit(": ", 1)[1] for u in unmatched] == [inside_a_name, "conformance/suite/test_gone.py"], unmatched
    top = md.split("| area |")[0]
    assert top.count("matches no collected test") == 2 and inside_a_name in top, top
    assert "matches no collected test" in proc.stdout, proc.stdout[-3000:]


def test_example_accelerator_is_never_the_default(example_env, tmp_path):
    """Installing the example changes no program's default accelerator, yet it is there to be named."""
    code = (
        "import json, os; os.environ.pop('HOSTOFFLOAD_ACCELERATOR', None);"
        "from reference.contract.accelerators import discover_accelerators, get_accelerator;"
        "print(json.dumps([sorted(discover_accelerators()), get_accelerator().name]))"
    )
    with_example = run_python(code, env=example_env, cwd=tmp_path)
    assert with_example.returncode == 0, with_example.stderr
    installed, default = json.loads(with_example.stdout)
    # Without the example: this process's own environment (the example is only on the child's PYTHONPATH).
    without = (sorted(discover_accelerators()), default_accelerator().name)
    assert "example-host" in installed and "example-host" not in without[0], (installed, without)
    assert default == without[1] != "example-host", (with_example.stdout, without)


class _PretendDevice(CpuAccelerator):
    """An always-available non-cpu accelerator, for the selection rule alone."""

    def __init__(self, name: str, may_be_default: bool) -> None:
        self.name = name
        self.may_be_default = may_be_default


def test_default_rule_skips_accelerators_that_may_not_be_default():
    cpu = CpuAccelerator()
    known: dict[str, Accelerator] = {"cpu": cpu, "aaa-test": _PretendDevice("aaa-test", False)}
    assert default_accelerator(known) is cpu
    device = _PretendDevice("zzz-device", True)
    assert default_accelerator({**known, "zzz-device": device}) is device
    assert Accelerator.may_be_default is True  # a vendor's device is a default unless it says otherwise


def test_expectation_entries_match_ids_where_a_part_ends():
    """The matching rule of conformance/harness/expectations.py, on ids alone."""
    from conformance.harness.expectations import _matches

    test = "conformance/suite/test_m.py::test_x[kernel=k-impl=a-acc=cpu-size]"
    for entry in ("conformance/suite", "conformance/suite/test_m.py", "conformance/suite/test_m.py::test_x",
                  "conformance/suite/test_m.py::test_x[", "conformance/suite/test_m.py::test_x[kernel=k", test):
        assert _matches(entry, test), entry
    for entry in ("conformance/suite/test_m", "conformance/suite/test_m.py::test", "conformance/suite/test_m.py::te",
                  "conformance/suite/test_m.py::test_x[kernel=k-impl=a-acc=cp", test + "x"):
        assert not _matches(entry, test), entry


def test_expectation_file_errors_name_the_option(tmp_path):
    from conformance.harness.expectations import ExpectationFile
    from reference.contract.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"--conformance-xfails=.*cannot be read"):
        ExpectationFile.load("--conformance-xfails", str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("# fine\nconformance/suite/test_m.py::test_x  also_this\n")
    with pytest.raises(ConfigurationError, match=r"--conformance-skips=.*line 2.*not one test id"):
        ExpectationFile.load("--conformance-skips", str(bad))

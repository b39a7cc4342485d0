"""Crash isolation: tests that drive an implementation's native code run in a child process.

A native ``abort()``, a segfault or an ``exit()`` inside the implementation under test must cost one failed test,
never the run: the other tests still run and the report is still written. The child's setup/call/teardown reports
are sent back and replayed here as if the test had run in this process. Two ways to get the child:

- ``fork()`` (Linux, the fast path, milliseconds): used while this process has not initialised CUDA (so the child
  initialises CUDA itself, and only there) and runs a single thread (a lock held by another thread at the fork
  would stay locked in the child forever). The child's file descriptors 1 and 2 go to a file (the crash report
  quotes its tail) and pytest's capture is switched to ``tee-sys`` so Python output reaches both.
- a fresh ``python -m pytest <file>::<test>`` with the same implementation, accelerator and profile: used
  otherwise (this process holds a CUDA context or other threads, or the platform has no ``fork``).

Which tests are isolated (``--conformance-isolation``):

- ``auto`` (default): tests marked ``isolated`` (probes that may fault by design, e.g. use-after-unpin reads), and
  every test of an implementation whose :class:`~reference.contract.capabilities.Capabilities` keep ``crash_isolation``
  (the default: third-party code is isolated unless it opts out), except tests marked ``runs_in_subprocesses``
  (their implementation code already runs in processes of their own, e.g. the engine's rank pool).
- ``all``: every test that takes ``impl``. ``off``: none (a crash then ends the run, as plain pytest would).

When the child dies, the test fails with the signal's name (or the exit status) and the last lines the child
printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from reference.contract import envvars

#: Set in the child: its reports go to this file, and nothing is isolated again.
CHILD_REPORTS_ENV = envvars.ISOLATED_REPORTS_ENV
#: How many of the child's last output lines a crash report quotes.
TAIL_LINES = 30
#: Seconds an isolated test may run before the child is killed and the test failed.
CHILD_TIMEOUT_S = 900


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "isolated: always run this test in a child process (it may crash by design)")
    config.addinivalue_line(
        "markers", "runs_in_subprocesses: the implementation code of this test already runs in child processes"
    )


def in_child() -> bool:
    return bool(os.environ.get(CHILD_REPORTS_ENV))


def should_isolate(item: pytest.Item) -> bool:
    if in_child():
        return False
    mode = item.config.getoption("conformance_isolation", None) or "auto"
    if mode == "off":
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl")
    if item.get_closest_marker("isolated") is not None:
        return True
    if impl is None:
        return False
    if mode == "all":
        return True
    if item.get_closest_marker("runs_in_subprocesses") is not None:
        return False
    return bool(impl.capabilities.crash_isolation)


def _child_command(item: pytest.Item) -> list[str]:
    config = item.config
    params = getattr(getattr(item, "callspec", None), "params", {})
    test_path = str(item.path) + "::" + item.nodeid.split("::", 1)[1]
    cmd = [sys.executable, "-m", "pytest", test_path, "-p", "no:cacheprovider", "-q", "-s", "--no-header",
           "-W", "ignore::DeprecationWarning", "--rootdir", str(config.rootpath)]
    if params.get("impl") is not None:
        cmd += ["--conformance-impl", params["impl"].name]
    if params.get("accelerator") is not None:
        cmd += ["--conformance-accelerator", params["accelerator"].name]
    profile = config.getoption("conformance_profile", None)
    if profile:
        cmd += ["--conformance-profile", profile]
    return cmd


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (signal {-returncode})"
    return f"exited with status {returncode} before reporting"


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return True  # cannot tell: do not fork


def _os_threads() -> int:
    """Threads of this process as the kernel counts them (native ones included), from /proc/self/status."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 2  # cannot tell: assume threads


def run_isolated(item: pytest.Item) -> list[pytest.TestReport]:
    """Run ``item`` in a child process and return its reports (a synthetic failed report if it crashed).

    ``fork()`` only while this process has a single thread: a lock another thread holds at the fork (an
    allocator's, torch's thread pool's, an io handle's) stays locked forever in the child, which then hangs.
    """
    if hasattr(os, "fork") and not _cuda_initialised() and _os_threads() == 1:
        return _run_forked(item)
    return _run_subprocess(item)


def _run_forked(item: pytest.Item) -> list[pytest.TestReport]:
    fd, out_path = tempfile.mkstemp(prefix="hostoffload-isolated-", suffix=".out")
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run the test, send the reports, never return into the parent's pytest
        code = 0
        try:
            os.close(read_end)
            _child_redirect(item.config, fd)
            from _pytest.runner import runtestprotocol

            _CHILD_PIPE[:] = [os.fdopen(write_end, "w")]
            runtestprotocol(item, log=True, nextitem=None)  # each report leaves through pytest_runtest_logreport
            _CHILD_PIPE[0].close()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    os.close(fd)
    chunks = []
    with os.fdopen(read_end, "rb") as r:
        while True:
            chunk = r.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    try:
        with open(out_path, errors="replace") as f:
            output = f.read()
    finally:
        os.unlink(out_path)
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines() if line.strip()]
    return _reports(item, lines, output, returncode, attach_output=False)


def _child_redirect(config: pytest.Config, fd: int) -> None:
    """In the forked child: fds 1 and 2 to ``fd``, and pytest's capture to tee-sys (Python output is captured
    for the report and also written to ``fd``; native output goes to ``fd`` directly)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import faulthandler

    if faulthandler.is_enabled():  # the Python stack of a crash belongs in the child's output, which is quoted
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    if capman is not None:
        from _pytest.capture import _get_multicapture

        capman._global_capturing = _get_multicapture("tee-sys")
        capman._global_capturing.start_capturing()


def _run_subprocess(item: pytest.Item) -> list[pytest.TestReport]:
    fd, report_path = tempfile.mkstemp(prefix="hostoffload-isolated-", suffix=".json")
    os.close(fd)
    env = {**os.environ, CHILD_REPORTS_ENV: report_path}
    try:
        try:
            proc = subprocess.run(
                _child_command(item), env=env, cwd=str(item.config.invocation_params.dir),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                timeout=CHILD_TIMEOUT_S,
            )
            output, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            output = out.decode(errors="replace") if isinstance(out, bytes) else out
            returncode = None
        with open(report_path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(report_path)
    return _reports(item, lines, output, returncode, attach_output=True)


def _tail(output: str) -> list[str]:
    """The child's last output lines; where faulthandler dumped a crash, the lines the child printed before it
    and the innermost frames of the dump (most recent call first), without its list of extension modules."""
    lines = [line for line in output.splitlines() if not line.startswith("Extension modules:")]
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return lines[max(0, i - TAIL_LINES // 3) : i] + lines[i : i + TAIL_LINES - TAIL_LINES // 3]
    return lines[-TAIL_LINES:]


def _reports(
    item: pytest.Item, lines: list[dict], output: str, returncode: int | None, *, attach_output: bool
) -> list[pytest.TestReport]:
    tail = _tail(output)
    reports = [item.config.hook.pytest_report_from_serializable(config=item.config, data=d) for d in lines]
    reports = [r for r in reports if isinstance(r, pytest.TestReport)]
    whens = {r.when for r in reports}
    crashed = returncode is None or "teardown" not in whens
    if not crashed:
        if attach_output and tail:
            for rep in reports:
                rep.sections.append(("isolated child output", "\n".join(tail)))
        return reports
    how = f"timed out after {CHILD_TIMEOUT_S}s" if returncode is None else describe_exit(returncode)
    phase = "setup" if not whens else ("call" if "call" not in whens else "teardown")
    message = (
        f"the isolated child running {item.path.name}::{item.name} {how} during {phase}; "
        f"its last output lines:\n"
        + ("\n".join(tail) if tail else "(none)")
    )
    crash = pytest.TestReport(
        nodeid=item.nodeid, location=item.location, keywords={k: 1 for k in item.keywords},
        outcome="failed", longrepr=message, when=phase, sections=[], duration=0.0,
    )
    kept = [r for r in reports if r.when != phase]
    return [*kept, crash] if phase != "teardown" else [*reports, crash]


def _write_child_report(config: pytest.Config, report: pytest.TestReport) -> None:
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(os.environ[CHILD_REPORTS_ENV], "a") as f:
        f.write(json.dumps(data) + "\n")
        f.flush()
        os.fsync(f.fileno())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In a child: send each report to the parent as soon as it exists, so that the phases that completed
    before a crash are reported as they were (the crash then fails the phase that was running)."""
    if _CHILD_PIPE:
        data = _CONFIG[0].hook.pytest_report_to_serializable(config=_CONFIG[0], report=report)
        _CHILD_PIPE[0].write(json.dumps(data) + "\n")
        _CHILD_PIPE[0].flush()
    elif in_child():
        _write_child_report(_CONFIG[0], report)


#: In a forked child: the pipe its reports go to (set only there).
_CHILD_PIPE: list[Any] = []


_CONFIG: list[Any] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG[:] = [session.config]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if not should_isolate(item):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for rep in run_isolated(item):
        from conformance import plugin

        plugin.record_report(item, rep)
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True

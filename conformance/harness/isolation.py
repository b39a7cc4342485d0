"""Crash isolation: tests that drive an implementation's native code run in a child process.

A native ``abort()``, a segfault or an ``exit()`` inside the implementation under test must cost one failed test,
never the run: the other tests still run and the report is still written. The child runs the test's whole pytest
protocol; its setup/call/teardown reports and warnings are sent back and replayed here as pytest made them
(:mod:`conformance.harness.isolation_reports`), and this process then tears its own fixtures down to what the next test
needs, as after an in-process test. Three ways to get the child:

- ``fork()`` (Linux, the fast path, milliseconds): used while this process has not initialised CUDA (so the child
  initialises CUDA itself, and only there) and runs a single thread (a lock held by another thread at the fork
  would stay locked in the child forever). The child's file descriptors 1 and 2 go to a file (the crash report
  quotes its tail) and pytest's capture is switched to ``tee-sys`` so Python output reaches both.
- a fork of the *zygote*: a fresh interpreter, started once per session right after collection with the same
  command line, that imports and collects everything, then waits single-threaded and forks one child per
  isolated test on request (``OPENBLAS_NUM_THREADS=1`` there, so that loading numpy starts no thread pool). Used
  once this process holds a CUDA context or other threads (importing torch starts one); the child gets this
  process's environment and working directory at the time of the test. It costs a fork (tens of milliseconds)
  where a fresh interpreter per test costs seconds, and its children are as clean as one: nothing of this
  process's state, no CUDA context, a single thread at the fork.
- a fresh ``python -m pytest <file>::<test>`` with the same implementation, accelerator and profile: the last
  resort (no ``fork``, the zygote could not start or is not single-threaded, or the test is not among what it
  collected).

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
from collections.abc import Callable
from typing import Any

import pytest

from conformance.harness.isolation_reports import (
    child_reports,
    decode_lines,
    encode_report,
    encode_warning,
    with_parent_teardown,
)
from reference.contract import envvars

#: Set in the child: its reports go to this file, and nothing is isolated again.
CHILD_REPORTS_ENV = envvars.ISOLATED_REPORTS_ENV
#: Seconds an isolated test may run before the child is killed and the test failed.
CHILD_TIMEOUT_S = 900


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "isolated: always run this test in a child process (it may crash by design)")
    config.addinivalue_line(
        "markers", "runs_in_subprocesses: the implementation code of this test already runs in child processes"
    )


def in_child() -> bool:
    return bool(_CHILD_PIPE) or bool(os.environ.get(CHILD_REPORTS_ENV))


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
    zygote = _ZYGOTE[0] if _ZYGOTE else None
    if zygote is not None and zygote.usable():
        reports = zygote.run(item)
        if reports is not None:
            return reports
    return _run_subprocess(item)


def _run_forked(item: pytest.Item) -> list[pytest.TestReport]:
    fd, out_path = tempfile.mkstemp(prefix="hostoffload-isolated-", suffix=".out")
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run the test, send the reports, never return into the parent's pytest

        def prepare() -> None:
            os.close(read_end)
            _own_setup_state(item)
            _child_redirect(item.config, fd)
            _CHILD_PIPE[:] = [os.fdopen(write_end, "w")]

        _run_item_and_exit(item, prepare, lambda: _CHILD_PIPE[0].close())
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
    return _reports(item, b"".join(chunks).decode(), output, returncode, attach_output=False, child="forked child")


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

    # the Python stack of a crash belongs in the child's output, which is quoted
    if faulthandler.is_enabled() and sys.__stderr__ is not None:
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
            lines = f.read()
    finally:
        os.unlink(report_path)
    return _reports(item, lines, output, returncode, attach_output=True, child="fresh interpreter")


def _reports(
    item: pytest.Item, lines: str, output: str, returncode: int | None, *, attach_output: bool, child: str
) -> list[pytest.TestReport]:
    """The reports of the child's ``lines`` (a crash report added if it died); the warnings among them are
    recorded here now, as pytest would have recorded them at the end of an in-process test."""
    reports, recorded = decode_lines(item.config, lines)
    for kwargs in recorded:
        item.ihook.pytest_warning_recorded.call_historic(kwargs=kwargs)
    return child_reports(item, reports, output, returncode, child=child, timeout_s=CHILD_TIMEOUT_S,
                         attach_output=attach_output)


def _send_to_parent(line: str) -> None:
    """In a child: one line to the parent, through the pipe (forked child) or the reports file (the others);
    in the kernel once written, so it survives this process's crash."""
    if _CHILD_PIPE:
        _CHILD_PIPE[0].write(line + "\n")
        _CHILD_PIPE[0].flush()
    else:
        with open(os.environ[CHILD_REPORTS_ENV], "a") as f:
            f.write(line + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In a child: send each report to the parent as soon as it exists, so that the phases that completed
    before a crash are reported as they were (the crash then fails the phase that was running)."""
    if in_child():
        _send_to_parent(encode_report(_CONFIG[0], report))


def pytest_warning_recorded(warning_message: Any, when: str, nodeid: str) -> None:
    """In a child: send each warning pytest recorded for the test, for the parent's warnings summary."""
    if in_child() and when == "runtest":
        _send_to_parent(encode_warning(warning_message, when, nodeid))


#: In a forked child: the pipe its reports go to (set only there).
_CHILD_PIPE: list[Any] = []


_CONFIG: list[Any] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG[:] = [session.config]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """An isolated test's protocol in the parent: the child runs setup, call and teardown; the parent then tears
    down what the next test no longer needs (its own wider-scoped fixtures, exactly as after an in-process test,
    so that its setup state stays a prefix of the next test's), and logs the reports in the usual order."""
    if not should_isolate(item):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = with_parent_teardown(run_isolated(item), _parent_teardown(item, nextitem))
    from conformance.harness import plugin

    for rep in reports:
        plugin.record_report(item, rep)
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _parent_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> pytest.TestReport:
    """The teardown phase of ``item`` in this process, as the report pytest would make of it: the setup state torn
    down to ``nextitem``, its output captured as pytest's capture plugin would. (Not the whole
    ``pytest_runtest_teardown`` hook: other plugins' parts of it expect their own setup part to have run here.)"""
    from _pytest.outcomes import Exit
    from _pytest.runner import CallInfo

    capman = item.config.pluginmanager.getplugin("capturemanager")

    def teardown() -> None:
        if capman is None:
            item.session._setupstate.teardown_exact(nextitem)
            return
        with capman.item_capture("teardown", item):
            item.session._setupstate.teardown_exact(nextitem)

    reraise: tuple[type[BaseException], ...] = (Exit,)
    if not item.config.getoption("usepdb", False):
        reraise += (KeyboardInterrupt,)
    return pytest.TestReport.from_item_and_call(item, CallInfo.from_call(teardown, when="teardown", reraise=reraise))


def _own_setup_state(item: pytest.Item) -> None:
    """In a forked child: keep the parent's set-up nodes (and the fixture values cached on them: the child uses
    them as an in-process test would) but none of their finalizers. The child tears down everything when its
    test ends; what it set up itself is finalized there, what the parent set up is the parent's to finalize
    (a module fixture's cleanup of a shared directory must not run once per isolated test)."""
    stack = item.session._setupstate.stack
    for node, (_finalizers, exc) in list(stack.items()):
        stack[node] = ([], exc)


# -- the zygote -----------------------------------------------------------------------------------------------------

#: Set in the zygote: "READ_FD,WRITE_FD" of its request and answer pipes.
ZYGOTE_ENV = envvars.ISOLATION_ZYGOTE_ENV
#: Seconds the zygote may take to start and collect before isolated tests fall back to fresh interpreters.
ZYGOTE_START_TIMEOUT_S = 600

_ZYGOTE: list[Any] = []


def in_zygote() -> bool:
    return bool(os.environ.get(ZYGOTE_ENV))


class Zygote:
    """The parent's side of the zygote: starts it, sends one request per isolated test, reads the answers.

    Requests and answers are JSON lines over two pipes. A request names the test (its node id), the files its
    child writes its reports and its output to, and this process's environment and working directory; the zygote
    answers with the child's pid once forked, then with its exit status. Any failure of the zygote itself (it
    died, answered nonsense, is not single-threaded, did not collect the test) makes :meth:`run` return None and
    the test runs in a fresh interpreter instead; the zygote is then not asked again.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.why_unusable: str | None = None
        self._ready: bool | None = None
        req_r, self._req_w = os.pipe()
        self._ans_r, ans_w = os.pipe()
        self._pending = b""
        basetemp = config._tmp_path_factory.getbasetemp() / "isolated"  # type: ignore[attr-defined]
        args = [*config.invocation_params.args, f"--basetemp={basetemp}"]
        seed = getattr(config.option, "hypothesis_seed", None)
        if seed is not None:
            args.append(f"--hypothesis-seed={seed}")
        env = {**os.environ, ZYGOTE_ENV: f"{req_r},{ans_w}", "OPENBLAS_NUM_THREADS": "1"}
        env.pop(CHILD_REPORTS_ENV, None)
        self._log = tempfile.TemporaryFile(prefix="hostoffload-zygote-")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args], env=env, cwd=str(config.invocation_params.dir),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(req_r, ans_w),
        )
        os.close(req_r)
        os.close(ans_w)

    def _send(self, message: dict) -> None:
        os.write(self._req_w, (json.dumps(message) + "\n").encode())

    def _answer(self, timeout: float) -> dict | None:
        """The zygote's next answer, or None if it sent none within ``timeout`` seconds. Read unbuffered (an
        answer already read into a buffer would be invisible to ``select``)."""
        import select
        import time

        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._ans_r], [], [], left)[0]:
                return None
            chunk = os.read(self._ans_r, 1 << 16)
            if not chunk:
                raise EOFError("the zygote exited")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def usable(self) -> bool:
        if self._ready is None:
            try:
                answer = self._answer(ZYGOTE_START_TIMEOUT_S)
            except (EOFError, OSError, ValueError) as exc:
                answer = {"ready": False, "why": str(exc)}
            if answer is None:
                answer = {"ready": False, "why": f"not ready within {ZYGOTE_START_TIMEOUT_S}s"}
            self._ready = bool(answer.get("ready"))
            if not self._ready:
                self._give_up(str(answer.get("why", "")))
        return bool(self._ready)

    def _give_up(self, why: str) -> None:
        self._ready = False
        if self.why_unusable is None:
            self.why_unusable = why
            import warnings

            warnings.warn(
                pytest.PytestWarning(f"crash isolation: the zygote is unusable ({why}); isolated tests run in "
                                     f"fresh interpreters (seconds each) instead"),
                stacklevel=1,
            )

    def run(self, item: pytest.Item) -> list[pytest.TestReport] | None:
        fd, report_path = tempfile.mkstemp(prefix="hostoffload-isolated-", suffix=".json")
        os.close(fd)
        fd, out_path = tempfile.mkstemp(prefix="hostoffload-isolated-", suffix=".out")
        os.close(fd)
        try:
            try:
                self._send({"nodeid": item.nodeid, "reports": report_path, "output": out_path,
                            "env": dict(os.environ), "cwd": os.getcwd()})
                started = self._answer(60)
                if started is not None and "skip" in started:  # this test only: the zygote did not collect it
                    return None
                if started is None or "pid" not in started:
                    self._give_up(f"no child for {item.nodeid}: {started}")
                    return None
                returncode: int | None
                done = self._answer(CHILD_TIMEOUT_S)
                if done is None:  # hung: kill the child (ours: the zygote forked it for us) and collect its status
                    os.kill(int(started["pid"]), signal.SIGKILL)
                    self._answer(60)
                    returncode = None
                else:
                    returncode = int(done["status"])
            except (EOFError, OSError, ValueError, KeyError, TypeError) as exc:
                self._give_up(f"{type(exc).__name__}: {exc}")
                return None
            with open(report_path) as f:
                lines = f.read()
            with open(out_path, errors="replace") as f:
                output = f.read()
        finally:
            os.unlink(report_path)
            os.unlink(out_path)
        return _reports(item, lines, output, returncode, attach_output=False, child="child of the zygote")

    def close(self) -> None:
        os.close(self._req_w)  # end of requests: a waiting zygote exits
        if self._ready is None:  # never used (still collecting, perhaps): nothing to wait for
            self._proc.kill()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._ans_r)
        self._log.close()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG), so that neither the zygote nor
    a test child outlives the run that started it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _serve(session: pytest.Session) -> None:
    """The zygote's loop: fork one child per request, answer its pid and exit status; exit at end of requests."""
    req_fd, ans_fd = (int(x) for x in os.environ[ZYGOTE_ENV].split(","))
    parent = os.getppid()
    _die_with_parent()
    answers = os.fdopen(ans_fd, "w")
    requests = os.fdopen(req_fd, "r")

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    items = {item.nodeid: item for item in session.items}
    session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # once, shared by the children
    import gc

    # What exists now is never garbage in a child (it was alive at the fork): frozen out of the collector, a
    # child's gc.collect() (every leak check makes one) neither walks it nor copies its pages on write.
    gc.collect()
    gc.freeze()
    threads = _os_threads()
    if threads != 1 or _cuda_initialised():
        answer({"ready": False, "why": f"the zygote runs {threads} threads after collection"
                + (" and holds a CUDA context" if _cuda_initialised() else "")})
        return
    answer({"ready": True})
    while os.getppid() == parent:
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        item = items.get(request["nodeid"])
        if item is None:
            answer({"skip": f"not collected here: {request['nodeid']}"})
            continue
        if _os_threads() != 1:
            answer({"error": "the zygote is no longer single-threaded"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _zygote_child(item, request, (req_fd, ans_fd))
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"status": os.waitstatus_to_exitcode(status)})


def _zygote_child(item: pytest.Item, request: dict, channels: tuple[int, int]) -> None:
    """In a child of the zygote: the parent's environment and directory, then the test; never returns."""

    def prepare() -> None:
        for fd in channels:
            os.close(fd)
        _die_with_parent()
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[CHILD_REPORTS_ENV] = request["reports"]
        os.chdir(request["cwd"])
        _child_redirect(item.config, os.open(request["output"], os.O_WRONLY | os.O_APPEND))

    _run_item_and_exit(item, prepare)


def _run_item_and_exit(
    item: pytest.Item, prepare: Callable[[], None], finish: Callable[[], None] | None = None
) -> None:
    """The body of every forked child: ``prepare`` (descriptors, environment, output), the test's whole protocol
    (each report leaves through ``pytest_runtest_logreport``), ``finish``; then ``os._exit`` -- status 3 if any of
    it raised -- so the child never returns into the pytest it was forked from."""
    code = 0
    try:
        prepare()
        # The whole hook, not just pytest's runtestprotocol: its wrappers (assertion comparison messages, warnings
        # capture, faulthandler timeout) must be around the test here as they are in-process.
        item.ihook.pytest_runtest_protocol(item=item, nextitem=None)
        if finish is not None:
            finish()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the zygote once the tests are known, if any of them will run isolated (and this is not a child)."""
    if in_zygote() or in_child() or _ZYGOTE or not hasattr(os, "fork"):
        return
    if session.config.getoption("collectonly", False) or not any(should_isolate(i) for i in session.items):
        return
    _ZYGOTE[:] = [Zygote(session.config)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """In the zygote, serving requests replaces running the tests; it then leaves without any session end (no
    report, no summary: those are the parent's)."""
    if not in_zygote():
        return None
    code = 0
    try:
        _serve(session)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return True  # pragma: no cover - os._exit above


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ZYGOTE:
        _ZYGOTE.pop().close()

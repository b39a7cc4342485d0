"""Swap I/O that must never hang or leak, on every implementation providing "io".

- A path that cannot hold records at offsets (a FIFO, a socket, a directory) is refused by ``write``/``read``
  at once with a ConfigurationError naming the path: a FIFO without a peer would otherwise block the caller, a
  worker thread and ``close()`` forever.
- A writer killed half way through a new-file write leaves its temporary behind; the next handle that creates a
  file in that directory removes it. A temporary of a live writer (here a stopped process) is never touched.
  These are observed on the directory itself, whatever names the implementation gives its temporaries.
- Sparse tensors are refused at once with a ConfigurationError naming ``tensor``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from conformance.areas.assertions import assert_names_argument
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("io")


def _call_without_hanging(fn, unblock, what: str) -> BaseException | None:
    """Run ``fn`` in a thread; if it is still blocked after 20 s, ``unblock()`` it and fail the test."""
    out: dict[str, BaseException | None] = {"exc": None}

    def body():
        try:
            fn()
        except BaseException as exc:  # inspected by the caller
            out["exc"] = exc

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(20)
    if th.is_alive():
        unblock()
        th.join(20)
        pytest.fail(f"{what} blocked for 20 s")
    return out["exc"]


def _fifo_unblocker(path: str):
    def unblock():
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a peer on both ends: any blocked open returns
        time.sleep(1)
        os.close(fd)

    return unblock


@pytest.mark.parametrize("op", ["write", "read"])
def test_fifo_is_refused_up_front_and_nothing_hangs(area_api, tmp_path, op):
    path = str(tmp_path / "swap.fifo")
    os.mkfifo(path)
    unblock = _fifo_unblocker(path)
    h = area_api.SwapHandle()
    try:
        exc = _call_without_hanging(lambda: getattr(h, op)(torch.ones(1024), path), unblock, f"{op}() to a FIFO")
        assert isinstance(exc, ConfigurationError), f"{op}() to a FIFO raised {exc!r}, expected ConfigurationError"
        assert path in str(exc) and "path" in str(exc), str(exc)
        assert _call_without_hanging(h.wait, unblock, "wait() after the refused FIFO request") is None
    finally:
        exc = _call_without_hanging(h.close, unblock, "close() after a FIFO request")
    assert exc is None, exc
    assert h.stats().requests == 0, "a refused request was submitted"


@pytest.mark.parametrize("kind", ["directory", "socket"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_other_non_files_are_refused_up_front(area_api, tmp_path, kind, op):
    path = str(tmp_path / f"target.{kind}")
    sock = None
    if kind == "directory":
        os.mkdir(path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
    try:
        with area_api.SwapHandle() as h:
            with pytest.raises(ConfigurationError) as info:
                getattr(h, op)(torch.ones(16), path)
            assert path in str(info.value) and "path" in str(info.value), str(info.value)
            assert h.stats().requests == 0
    finally:
        if sock is not None:
            sock.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_sparse_tensor_is_refused_naming_the_argument(area_api, tmp_path, op):
    sparse = torch.eye(4).to_sparse()
    with area_api.SwapHandle() as h:
        with pytest.raises(ConfigurationError) as info:
            getattr(h, op)(sparse, str(tmp_path / "x.bin"))
        assert_names_argument(info.value, "tensor")
        assert h.stats().requests == 0
    assert os.listdir(tmp_path) == []


_WRITER = textwrap.dedent(
    """
    import importlib, os, sys, torch
    io = importlib.import_module(sys.argv[1])
    directory = sys.argv[2]
    t = torch.ones(4 << 20)  # 16 MiB in 4 KiB calls: each new file spends a while under its temporary name
    with io.SwapHandle(block_size=4096, queue_depth=1, num_threads=1) as h:
        for k in range(100000):
            h.write(t, os.path.join(directory, f"done{k}.bin")).wait()
    """
)


def _leftovers(directory: str) -> set[str]:
    """Entries that are not a finished file (all end in .bin): temporaries, whatever their names."""
    return {n for n in os.listdir(directory) if not n.endswith(".bin")}


def _start_writer(module: str, directory: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, module, directory], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _signal_with_temporary(proc: subprocess.Popen, directory: str, sig: int) -> set[str]:
    """Send ``sig`` to the writer at a moment its temporary exists; return the temporaries left standing."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the writer exited early: {proc.stderr.read().decode()[-2000:]}")
        if _leftovers(directory):
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(30)
            else:
                time.sleep(0.2)  # SIGSTOP is asynchronous: let it land
            left = _leftovers(directory)
            if left:
                return left
            if sig == signal.SIGSTOP:
                proc.send_signal(signal.SIGCONT)
            else:
                return set()  # it died between two files: the caller starts another writer
        time.sleep(0.002)
    pytest.fail("no temporary file seen within 60 s")


def test_dead_writers_temporaries_are_removed_live_writers_kept(impl, area_api, tmp_path):
    directory = str(tmp_path)
    module = impl.areas["io"]
    live = _start_writer(module, directory)
    try:
        live_left = _signal_with_temporary(live, directory, signal.SIGSTOP)
        # A handle creating a file here sweeps the directory: the stopped writer is alive, its temporary stays.
        with area_api.SwapHandle() as h:
            h.write(torch.ones(8), str(tmp_path / "probe1.bin")).wait()
        assert live_left <= set(os.listdir(directory)), "a live writer's temporary was removed"
        live.send_signal(signal.SIGCONT)
        dead_left = _signal_with_temporary(live, directory, signal.SIGKILL)
        for _ in range(5):
            if dead_left:
                break
            live.stderr.close()
            live = _start_writer(module, directory)
            dead_left = _signal_with_temporary(live, directory, signal.SIGKILL)
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGCONT)
            live.kill()
            live.wait(30)
        live.stderr.close()
    assert dead_left, "sanity: the killed writer left a temporary"
    # The next handle creating a file in the directory removes what the dead writer left.
    with area_api.SwapHandle() as h:
        h.write(torch.ones(8), str(tmp_path / "probe2.bin")).wait()
    left = _leftovers(directory)
    assert not left, f"a dead writer's temporaries were not removed: {sorted(left)}"

"""A pool of rank processes joined in one torch.distributed group, reused across runs (harness machinery:
the engine tests and the distributed-engine scenario runner run their rank functions here, whatever engine the
implementation under test declares).

Why a pool: the conformance suite runs hundreds of small scenarios; spawning W interpreters that import torch and
rendezvous costs seconds per scenario, running one on a warm pool costs milliseconds. The pool's processes form
one group of ``size`` ranks (rendezvous through a file store in a private temporary directory, so concurrent
pools never collide on a port) plus one sub-group for every prefix ``[0, w)``; a run of world size ``w`` uses
ranks ``0..w-1`` and that sub-group.

Failure policy (no rank may hang): each rank reports its result or its exception. When one rank fails, the
others get ``grace_s`` seconds to report too (their next collective fails once the process group times out, or
they finish); a rank still silent after that is stuck, and the whole pool is killed and rebuilt on the next run.
The pool is also discarded whenever the ranks did not all succeed or all fail the same way, because the
collective sequence of its group is then unknown.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from conformance.harness.environment import apply_environment
from reference.contract.errors import HostOffloadError

__all__ = ["RankFailure", "WorkerPool", "WorkerTimeoutError", "get_pool", "shutdown_pools"]

#: Environment variables copied into the workers before every run (the parent's values at call time).
FORWARDED_ENV = (
    "HOSTOFFLOAD_ACCELERATOR",
    "HOSTOFFLOAD_PIN_BACKEND",
    "HOSTOFFLOAD_PIN_REGISTER_DEVICE",
    "HOSTOFFLOAD_CPU_ADAM_THREADS",
    "HOSTOFFLOAD_ZERO_HOST_MEMORY",
)


class WorkerTimeoutError(HostOffloadError, TimeoutError):
    """A rank process did not answer in time; the pool was killed."""


@dataclass
class RankFailure:
    """What a rank sends back instead of a result."""

    rank: int
    exception: BaseException | None
    type_name: str
    message: str
    traceback: str


def _worker_main(rank: int, size: int, backend: str, store_path: str, timeout_s: float, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # before the group exists, so NCCL binds this rank to its GPU
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # new_group does not inherit the world's timeout: give every sub-group the same one.
        timeout = datetime.timedelta(seconds=timeout_s)
        groups = {w: dist.new_group(list(range(w)), timeout=timeout) for w in range(1, size + 1)}
        conn.send(("ready", rank))
    except BaseException as exc:
        conn.send(("error", _failure(rank, exc)))
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        fn, world, args, env = job
        apply_environment(env)
        try:
            result = fn(groups[world], *args)
            conn.send(("ok", result))
        except BaseException as exc:
            try:
                conn.send(("error", _failure(rank, exc)))
            except (OSError, EOFError):
                break
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Leave at once: every result went out through the pipe when it was sent, and a normal interpreter exit with
    # torch loaded (its atexit hooks, then finalising every module) takes one to two seconds, which close() paid
    # for every pool it stopped (its join gives up after 2 s and kills) -- seconds per fault test, for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure(rank: int, exc: BaseException) -> RankFailure:
    import pickle

    tb = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
        kept: BaseException | None = exc
    except Exception:
        kept = None
    return RankFailure(rank, kept, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb)


class WorkerPool:
    """``size`` rank processes of one ``backend`` group. Use :func:`get_pool`."""

    def __init__(self, size: int, backend: str, *, timeout_s: float, start_timeout_s: float = 180.0) -> None:
        self.size = size
        self.backend = backend
        self.timeout_s = timeout_s
        self._dir = tempfile.mkdtemp(prefix="hostoffload-zero-")
        ctx = mp.get_context("spawn")
        self._procs = []
        self._conns: list[Connection] = []
        self.broken = False
        try:
            for r in range(size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_worker_main,
                    args=(r, size, backend, os.path.join(self._dir, "store"), timeout_s, child),
                    daemon=True,
                    name=f"hostoffload-zero-rank{r}",
                )
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            replies = self._collect(list(range(size)), start_timeout_s, grace_s=5.0)
            failures = [v for v in replies.values() if isinstance(v, RankFailure)]
            if failures:
                raise RuntimeError(f"rank {failures[0].rank} could not join the {backend} group: {failures[0].message}")
        except BaseException:
            self.close()
            raise

    def _collect(self, ranks: list[int], timeout_s: float, grace_s: float) -> dict[int, Any]:
        """Replies of ``ranks``: a result or a :class:`RankFailure`. Kills the pool when a rank is stuck."""
        pending = {self._conns[r]: r for r in ranks}
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = sorted(pending.values())
                self.close()
                failed = [r for r, v in out.items() if isinstance(v, RankFailure)]
                if failed:
                    return out  # the failing rank's error is what the caller reports
                raise WorkerTimeoutError(
                    f"ranks {stuck} did not finish within {timeout_s:.0f}s; the worker pool was killed "
                    f"(timeout_s / HOSTOFFLOAD_ACCUMULATION_TIMEOUT sets the limit)"
                )
            ready: list[Any] = wait(list(pending), timeout=left)  # our Connections (typed for sockets, fds too)
            for conn in ready:
                r = pending.pop(conn)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[r].exitcode
                    self.broken = True
                    out[r] = RankFailure(r, None, "builtins.RuntimeError", f"rank process exited (code {code})", "")
                    continue
                out[r] = value
                if isinstance(value, RankFailure) or kind == "error":
                    # One rank failed: the others get a short grace period, then are considered stuck.
                    deadline = min(deadline, time.monotonic() + grace_s)
        return out

    def run(self, fn: Callable[..., Any], world: int, args: tuple, *, grace_s: float) -> dict[int, Any]:
        """Run ``fn(group, *args)`` on ranks ``0..world-1``; returns each rank's result or RankFailure."""
        if self.broken:
            raise RuntimeError("the worker pool is broken; get a new one with get_pool()")
        env = {k: os.environ.get(k) for k in FORWARDED_ENV}
        for r in range(world):
            try:
                self._conns[r].send((fn, world, args, env))
            except (OSError, EOFError) as exc:
                self.close()
                raise RuntimeError(f"rank {r} of the worker pool is gone: {exc}") from exc
        out = self._collect(list(range(world)), self.timeout_s + 60.0, grace_s)
        outcomes = {type(v).__name__ if not isinstance(v, RankFailure) else v.type_name for v in out.values()}
        if len(out) < world or (any(isinstance(v, RankFailure) for v in out.values()) and len(outcomes) > 1):
            self.close()
        return out

    def close(self) -> None:
        self.broken = True
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, EOFError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)


_POOLS: dict[str, WorkerPool] = {}


def get_pool(world: int, backend: str, *, timeout_s: float, min_size: int = 1) -> WorkerPool:
    """A live pool of at least ``world`` (and ``min_size``) ranks for ``backend``, reused while healthy."""
    pool = _POOLS.get(backend)
    if pool is not None and (pool.broken or pool.size < world or pool.timeout_s != timeout_s):
        pool.close()
        pool = None
    if pool is None:
        pool = WorkerPool(max(world, min_size), backend, timeout_s=timeout_s)
        _POOLS[backend] = pool
    return pool


def shutdown_pools() -> None:
    """Stop every pool's processes (also registered with atexit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)

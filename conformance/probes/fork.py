"""Run in a fresh process: pin with the native backend, fork, and report what parent and children observe.

Used by the suite's fork test (conformance/suite/test_pinning_fork.py), which holds the assertions; this probe only
observes. It runs in its own interpreter because it forks: a fork of the pytest process would copy whatever
threads and locks the harness holds. Page-locked memory is read from ``/proc/self/status`` (VmLck) in each process
itself, never from the implementation's counters.

Phases (one JSON line on stdout):

1. ``single``: the parent pins a buffer (and a view of it) and pins-then-unpins a second one, then forks once
   without other threads. The child reports the rule's observables for the inherited buffers, pins (and unpins) a
   fresh buffer of its own, pins one more and forks a grandchild, then drops the inherited tensors. The parent
   reports the same observables before and after the child ran.
2. ``threaded``: worker threads pin, look up, unpin and drop native buffers without pause while the main thread
   forks repeatedly; every child must see no inherited pin at all and be able to pin, look up and unpin at once
   (a lock held by a worker at the fork would hang it: the child is killed after a deadline and reported).

Usage: ``python -m conformance.probes.fork <pinning module> <ranges module>``.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any

BUFFER = 256 * 1024
SMALL = 64 * 1024
CHILD_DEADLINE_S = 20.0
THREADED_FORKS = 16
WORKERS = 3


def vm_locked_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def run_child(body) -> dict:
    """Fork; the child runs ``body()`` and sends its JSON result through a pipe. Returns it, or what went wrong."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller's code
        status = 0
        try:
            os.close(read_fd)
            signal.alarm(int(CHILD_DEADLINE_S) + 5)  # a hang must end the child even if the parent is gone
            try:
                result = {"ok": True, **body()}
            except BaseException as exc:
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            data = json.dumps(result).encode()
            while data:
                data = data[os.write(write_fd, data):]
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_DEADLINE_S
    hung = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            hung = True
            break
        ready, _, _ = select.select([read_fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    if hung:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if hung:
        return {"ok": False, "error": f"the child hung for {CHILD_DEADLINE_S} s (killed)"}
    if not chunks:
        return {"ok": False, "error": f"the child died without reporting (wait status {status})"}
    return json.loads(b"".join(chunks))


def main() -> None:
    api = importlib.import_module(sys.argv[1])
    ranges = importlib.import_module(sys.argv[2])
    import torch

    # torch's intra-op pool (OpenMP) is not fork-safe: a child of a parent that used it hangs in its next parallel
    # op. One thread keeps every op inline, so a hang can only come from the implementation under test.
    torch.set_num_threads(1)
    registry = ranges.global_registry()

    def observe(t, view) -> dict:
        found = registry.find(t.data_ptr())
        return {
            "is_pinned": bool(api.is_pinned(t)),
            "view_is_pinned": bool(api.is_pinned(view)),
            "in_registry": found is not None,
            "stats": list(api.pinned_stats()),
            "vmlck_kib": vm_locked_kib(),
        }

    baseline = {"stats": list(api.pinned_stats()), "vmlck_kib": vm_locked_kib(), "ranges": len(registry)}
    pattern = torch.arange(BUFFER, dtype=torch.int64).remainder(251).to(torch.uint8)
    # Held in a dict, never in local names, so the child can drop every reference to the inherited tensors.
    held = {"t": api.pin_empty(BUFFER, dtype=torch.uint8)}
    held["t"].copy_(pattern)
    held["view"] = held["t"][1000:3000]
    held["unpinned"] = api.pin_empty(SMALL, dtype=torch.uint8)
    unpinned_ok = bool(api.unpin(held["unpinned"]))
    parent_before = observe(held["t"], held["view"])

    def single_child() -> dict:
        out: dict = {"inherited": observe(held["t"], held["view"])}
        out["values_intact"] = bool(torch.equal(held["t"], pattern))
        out["unpin_inherited"] = bool(api.unpin(held["t"]))
        out["unpin_inherited_unpinned"] = bool(api.unpin(held["unpinned"]))
        out["after_unpin"] = observe(held["t"], held["view"])
        # Pinning still works in the child: nothing it needs is left locked, and its own pins are real.
        before = vm_locked_kib()
        own = api.pin_empty(BUFFER, dtype=torch.uint8)
        own.fill_(3)
        out["own"] = {"is_pinned": bool(api.is_pinned(own)), "vmlck_grew_kib": vm_locked_kib() - before,
                      "stats": list(api.pinned_stats())}
        copied = api.pin_memory(torch.ones(1000))
        out["own_copy_pinned"] = bool(api.is_pinned(copied))
        del copied
        out["own_unpin"] = bool(api.unpin(own))
        out["own_after_unpin"] = {"is_pinned": bool(api.is_pinned(own)), "vmlck_grew_kib": vm_locked_kib() - before}
        del own
        # One more generation: what the child pinned is inherited, and not pinned, in the grandchild.
        mine = {"kept": api.pin_empty(SMALL, dtype=torch.uint8)}
        mine["view"] = mine["kept"][10:20]
        out["grandchild"] = run_child(lambda: {"inherited": observe(mine["kept"], mine["view"]),
                                               "unpin": bool(api.unpin(mine["kept"]))})
        out["kept_after_grandchild"] = observe(mine["kept"], mine["view"])
        out["kept_unpin"] = bool(api.unpin(mine["kept"]))
        mine.clear()
        # Dropping the inherited tensors releases their mappings (no unlock, no unregistration: none here).
        held.clear()
        gc.collect()
        out["after_drop"] = {"stats": list(api.pinned_stats()), "vmlck_kib": vm_locked_kib(),
                             "ranges": len(registry)}
        return out

    child = run_child(single_child)
    parent_after = observe(held["t"], held["view"])
    parent_unpin = bool(api.unpin(held["t"]))
    parent_after_unpin = observe(held["t"], held["view"])
    held.clear()
    gc.collect()
    single = {"baseline": baseline, "unpinned_ok": unpinned_ok, "parent_before": parent_before, "child": child,
              "parent_after": parent_after, "parent_unpin": parent_unpin, "parent_after_unpin": parent_after_unpin,
              "parent_end": {"stats": list(api.pinned_stats()), "vmlck_kib": vm_locked_kib(),
                             "ranges": len(registry)}}

    # -- threaded: fork while other threads are inside pin / unpin / release --------------------------------------
    stop = threading.Event()
    errors: list[str] = []
    churned = [0] * WORKERS

    def churn(index: int) -> None:
        try:
            held = []
            while not stop.is_set():
                buf = api.pin_empty(4096 * (1 + churned[index] % 8), dtype=torch.uint8)
                if not api.is_pinned(buf[1:]):
                    errors.append(f"worker {index}: a fresh pin is not pinned")
                held.append(buf)
                if len(held) > 4:
                    victim = held.pop(0)
                    if churned[index] % 2:
                        api.unpin(victim)
                    del victim
                churned[index] += 1
        except BaseException as exc:
            errors.append(f"worker {index}: {type(exc).__name__}: {exc}")

    def threaded_child() -> dict:
        start: dict[str, Any] = {
            "stats": list(api.pinned_stats()), "vmlck_kib": vm_locked_kib(), "ranges": len(registry)
        }
        own = api.pin_empty(SMALL, dtype=torch.uint8)
        pinned = bool(api.is_pinned(own))
        grew = vm_locked_kib() - start["vmlck_kib"]
        unpinned_now = bool(api.unpin(own))
        return {"start": start, "own_pinned": pinned, "own_vmlck_grew_kib": grew, "own_unpinned": unpinned_now}

    workers = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(WORKERS)]
    for w in workers:
        w.start()
    children = []
    try:
        while min(churned) < 5 and not errors:
            time.sleep(0.01)
        for _ in range(THREADED_FORKS):
            time.sleep(0.005)
            children.append(run_child(threaded_child))
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    gc.collect()
    threaded = {"children": children, "worker_errors": errors, "churned": churned,
                "end": {"stats": list(api.pinned_stats()), "vmlck_kib": vm_locked_kib(), "ranges": len(registry)}}
    print(json.dumps({"single": single, "threaded": threaded, "buffer": BUFFER, "small": SMALL}))


if __name__ == "__main__":
    main()

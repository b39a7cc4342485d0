"""Run in a fresh process: lend tensors to an area's declared ``transport_handoff``, fork, and report what parent
and children observe.

Used by ``test_accumulation_transport_handoff`` (which holds the assertions); this probe only observes. It runs in
its own interpreter because it forks (a fork of the pytest process would copy the harness's threads and locks).
The transport is faked as in the test module: a list keeping a view of each lent alias, the C++ reference a gloo
worker's work holds; in a child that list is a copy, so the parent's transport seems to go on referencing the
aliases there, while no thread of it exists to ever let go of them.

Phases (one JSON line on stdout):

1. ``single``: the parent lends one tensor (its transport keeps a reference), forks once without other threads.
   The child reports ``held()`` and whether ``drain`` succeeds at once, then lends, releases and drains a tensor
   of its own. The parent reports ``held()`` after the child ran, whether a short ``drain`` (wrongly) succeeds
   while its transport still references the alias, and whether it drains once the transport lets go.
2. ``threaded``: a worker thread lends without pause (with a backlog of aliases its transport references, so
   it holds the handoff's lock most of the time) while the main thread forks repeatedly; every child must start
   with nothing held and lend and drain at once (a lock the worker held at the fork would hang it: the child is
   killed after a deadline and reported).

Usage: ``python -m conformance.probes.handoff_fork <accumulation module>``.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading

from conformance.probes.fork import run_child

THREADED_FORKS = 12
BACKLOG = 2000


def main() -> None:
    area = importlib.import_module(sys.argv[1])
    import torch

    torch.set_num_threads(1)  # torch's intra-op pool is not fork-safe; see conformance/probes/fork.py
    handoff = area.transport_handoff
    transport: list[torch.Tensor] = []  # the parent's transport: its references to what it was handed

    def own_round_trip() -> dict:
        """Lend a tensor of this process's own, let this process's transport release it, drain."""
        mine = handoff.lend(torch.ones(4))
        refs = [a.view(-1) for a in mine]
        del mine
        held = handoff.held()
        refs.clear()
        return {"own_held": held, "own_drained": bool(handoff.drain(timeout=5.0)), "end_held": handoff.held()}

    start_drained = bool(handoff.drain(timeout=5.0))
    transport.extend(a.view(-1) for a in handoff.lend(torch.arange(16.0)))
    parent_before = handoff.held()

    def single_child() -> dict:
        out = {"held_at_start": handoff.held(), "drained_at_once": bool(handoff.drain(timeout=0.2))}
        return {**out, **own_round_trip()}

    child = run_child(single_child)
    parent_after = handoff.held()
    early = bool(handoff.drain(timeout=0.05))  # the transport still references the alias: must be False
    transport.clear()
    single = {"start_drained": start_drained, "parent_before": parent_before, "child": child,
              "parent_after": parent_after, "parent_drain_while_referenced": early,
              "parent_drained": bool(handoff.drain(timeout=5.0)), "parent_end_held": handoff.held()}

    stop = threading.Event()

    # Aliases the worker's transport references throughout: each lend() scans them under the handoff's lock, so
    # the worker holds that lock most of the time and a fork (which happens when the worker gives up the GIL)
    # mostly finds it held. Without the backlog, the lock is held for microseconds of each loop and a fork
    # would rarely see it taken.
    backlog = [a.view(-1) for a in handoff.lend(*[torch.zeros(1) for _ in range(BACKLOG)])]

    def churn() -> None:
        while not stop.is_set():
            handoff.lend(torch.zeros(1))  # released at once: the next lend lets go of it

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    try:
        children = []
        for _ in range(THREADED_FORKS):
            children.append(run_child(lambda: {"held_at_start": handoff.held(), **own_round_trip()}))
            if not children[-1]["ok"]:
                break  # a hung child waits out the deadline: one is the finding, more only cost time
    finally:
        stop.set()
        worker.join()
        backlog.clear()
        handoff.drain(timeout=5.0)
    print(json.dumps({"single": single, "threaded": children}), flush=True)


if __name__ == "__main__":
    main()

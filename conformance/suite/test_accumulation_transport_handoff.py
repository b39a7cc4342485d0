"""An engine's transport handoff (the area module's optional ``transport_handoff``): no tensor handed to a
collective is last released by a transport thread.

Why it matters: ``work.wait()`` returns while a gloo worker still references the work's tensors; if Python let
go of them first, the worker's release frees the Python object and needs the GIL, and during interpreter exit
that kills the process ("terminate called without an active exception") after the script finished. The race is
timing-dependent (about 1 in 5 two-rank exits after 50 asynchronous broadcasts of temporaries on a 2-core box
without a handoff, none with one), so these tests check the mechanism deterministically instead: a fake
transport keeps a C++ reference (a view) the way a gloo worker does, and releases it when the test says so.

The handoff is an optional component an area module declares by name (as ``fused_device_adam``): an object with
``lend(*tensors)`` (the aliases to post instead), ``held()`` and ``drain(timeout)``, serving the area's
``Collectives(group)`` (``start_reduce_scatter``, ``all_gather_into``, ``broadcast_pieces``). An
implementation without it is skipped here and judged by its exits elsewhere. The fake transport replaces
torch.distributed's own functions, which is how any implementation reaches a transport.

Fork: a transport's threads do not exist in a forked child, so nothing the parent's transport references can
ever be released there. A child starts with nothing held (its ``drain`` returns at once, and the handoff serves
the child's own collectives), and the fork changes nothing in the parent (what its transport still references
stays held). :mod:`conformance.probes.handoff_fork` observes both in a fresh interpreter, also with a thread
lending and draining at the moment of each fork.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.conformance_area("accumulation")


def _declared(impl, *names: str) -> list:
    area = impl.load("accumulation")
    found = [getattr(area, name, None) for name in names]
    missing = [n for n, f in zip(names, found, strict=True) if f is None]
    if missing:
        pytest.skip(f"{impl.name} declares no {', '.join(missing)} in its accumulation area")
    return found


class _FakeTransport:
    """Keeps, per posted operation, a view of each tensor it was given (a C++ reference, as a gloo worker's
    work holds one) until :meth:`finish` drops them all."""

    def __init__(self) -> None:
        self.received: list[torch.Tensor] = []
        self._refs: list[torch.Tensor] = []

    def post(self, *tensors: torch.Tensor) -> types.SimpleNamespace:
        self.received.extend(tensors)
        self._refs.extend(t.view(-1) for t in tensors)
        return types.SimpleNamespace(wait=lambda: None)

    def finish(self) -> None:
        self._refs.clear()


@pytest.fixture
def handoff(impl):
    """The implementation's declared handoff, with nothing held at the start (earlier tests' transports are
    gone) and drained again at the end."""
    (h,) = _declared(impl, "transport_handoff")
    assert h.drain(timeout=5.0) and h.held() == 0, "the handoff still holds tensors no transport references"
    yield h
    h.drain(timeout=0)


def test_lent_alias_outlives_the_transports_reference_and_drain_waits_for_it(handoff):
    transport = _FakeTransport()
    caller = torch.arange(16.0)
    (alias,) = handoff.lend(caller)
    assert alias is not caller and alias.data_ptr() == caller.data_ptr(), "the transport gets an alias of the memory"
    transport.post(alias)
    del alias, caller  # the engine lets go right after wait(), as PendingReduce and the gathers do
    assert handoff.held() == 1, "the alias must stay held while the transport still references it"
    assert not handoff.drain(timeout=0.05), "drain() reported success while the transport still held a tensor"
    assert handoff.held() == 1
    transport.finish()
    assert handoff.drain(timeout=5.0), "drain() did not let go once the transport had released its reference"
    assert handoff.held() == 0


def test_lend_lets_go_of_released_aliases_and_ignores_other_owners(handoff):
    """Views and autograd references of the caller's tensor are not the transport's: they keep nothing held
    (an alias of a tensor with live views is released once the transport lets go)."""
    weight = torch.zeros(8, requires_grad=True)
    base = weight.detach()
    views = [base[:4], base[4:]]  # other owners of ``base``: its use count stays above 1
    transport = _FakeTransport()
    transport.post(*handoff.lend(base))
    transport.finish()
    handoff.lend(torch.ones(2))  # lending again prunes what the transport released
    assert handoff.held() == 1, "an alias the transport released was still held (or one still in use was dropped)"
    assert handoff.drain(timeout=5.0) and handoff.held() == 0
    assert all(v.data_ptr() for v in views)


def _fake_transport_functions(monkeypatch, transport: _FakeTransport) -> None:
    """torch.distributed as a two-rank gloo group whose collectives post to ``transport``."""
    for name, fake in {
        "get_world_size": lambda group=None: 2,
        "get_rank": lambda group=None: 0,
        "get_global_rank": lambda group, r: r,
        "get_backend": lambda group=None: "gloo",
        "broadcast": lambda t, src, group=None, async_op=False: transport.post(t),
        "all_to_all_single": lambda out, inp, out_splits=None, in_splits=None, group=None, async_op=False:
            transport.post(out, inp),
        "all_gather_into_tensor": lambda out, part, group=None, async_op=False: transport.post(out, part),
        "all_gather_single": lambda out, part, group=None, async_op=False: transport.post(out, part),
    }.items():
        monkeypatch.setattr(dist, name, fake, raising=False)


def test_every_collective_hands_the_transport_held_aliases(impl, handoff, monkeypatch):
    """Reduce-scatter, all-gather (and so the object gather) and the stage-3 broadcasts all go through the
    handoff: the transport never receives a caller's tensor object, and each one it received stays held until
    it lets go."""
    (collectives_class,) = _declared(impl, "Collectives")
    transport = _FakeTransport()
    _fake_transport_functions(monkeypatch, transport)
    comm = collectives_class(object())
    callers = [torch.ones(4), torch.zeros(8), torch.ones(2), torch.full((3,), 2.0)]
    comm.start_reduce_scatter(callers[0], [2, 2]).result()
    comm.all_gather_into(callers[1], callers[2])
    comm.broadcast_pieces([(1, callers[3])])
    got = transport.received
    assert len(got) == 5, f"expected 5 tensors posted (2 + 2 + 1), got {len(got)}"
    assert not any(g is c for g in got for c in callers), "a caller's tensor object went to the transport"
    assert {c.data_ptr() for c in callers} <= {g.data_ptr() for g in got}
    del got
    transport.received.clear()
    assert handoff.held() == 5, "every tensor the transport references must be held until it lets go"
    transport.finish()
    assert handoff.drain(timeout=5.0) and handoff.held() == 0


_fork_reports: dict[str, dict] = {}


@pytest.fixture
def fork_report(impl) -> dict:
    """The fork probe's observations for this implementation (one probe run serves the module's fork tests)."""
    _declared(impl, "transport_handoff")
    module = impl.areas["accumulation"]
    if module not in _fork_reports:
        proc = subprocess.run([sys.executable, "-m", "conformance.probes.handoff_fork", module],
                              env={**os.environ, "HOSTOFFLOAD_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"the fork probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        _fork_reports[module] = json.loads(proc.stdout.strip().splitlines()[-1])
    return _fork_reports[module]


def test_a_forked_child_starts_with_nothing_held_and_the_parent_keeps_its_own(fork_report):
    """After ``fork()`` with an alias lent and still referenced by the parent's transport: the child holds
    nothing (else its ``drain`` -- at interpreter exit too -- waits for a transport thread that does not exist
    there) and can lend and drain its own tensors; the parent still holds the alias (a drain that succeeds
    while the transport references it is the crash the handoff prevents) until its transport lets go."""
    s = fork_report["single"]
    assert s["start_drained"] and s["parent_before"] == 1, f"premise: one alias held before the fork: {s}"
    child = s["child"]
    assert child["ok"], f"the forked child failed: {child.get('error')}"
    assert child["held_at_start"] == 0, f"the child inherited {child['held_at_start']} held tensors"
    assert child["drained_at_once"], "drain() in the child waited for the parent's transport"
    assert (child["own_held"], child["own_drained"], child["end_held"]) == (1, True, 0), (
        f"the handoff does not serve the child's own transport: {child}"
    )
    assert s["parent_after"] == 1, f"the fork changed what the parent holds: {s['parent_after']} held, expected 1"
    assert not s["parent_drain_while_referenced"], "after the fork, the parent let go of an alias its transport holds"
    assert s["parent_drained"] and s["parent_end_held"] == 0, f"the parent did not drain once released: {s}"


def test_a_fork_while_another_thread_lends_leaves_the_child_a_usable_handoff(fork_report):
    """Forks while a worker thread lends and drains without pause: a lock the worker held at the fork must not be
    inherited locked (the child would hang at its first lend), and every child starts with nothing held."""
    children = fork_report["threaded"]
    for i, child in enumerate(children):
        assert child["ok"], f"fork {i}: the child failed: {child.get('error')}"
        assert child["held_at_start"] == 0, f"fork {i}: the child inherited {child['held_at_start']} held tensors"
        assert (child["own_held"], child["own_drained"], child["end_held"]) == (1, True, 0), f"fork {i}: {child}"

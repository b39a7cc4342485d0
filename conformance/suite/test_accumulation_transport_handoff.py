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
"""

from __future__ import annotations

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

"""Differential testing: an implementation and the reference agree on every state-machine trace.

The model-based machines (test_ranges_state_machine.py) check each implementation against a plain model; this
module checks it against the reference itself, observation by observation, so any divergence the model does
not spell out (error types and messages, the order of overlap checks, results on malformed arguments, owner
tokens) still shows up. Two machines run one trace on both sides at once:

- ``RegistryAgreement``: private ``RangeRegistry`` objects of both implementations, fed the same adds
  (including overlapping and malformed ones), removes and probes; every result and every exception must match.
- ``PinningAgreement``: the same pin / view / unpin / drop / lookup trace through both implementations' native
  pinning; every ``is_pinned`` and ``unpin`` result and every ``pinned_stats`` delta must match.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conformance.areas.stateful import rule_failed
from conformance.harness.profiles import state_machine_settings

pytestmark = pytest.mark.conformance_area("ranges")

_BASE = 1 << 20

# Arguments a caller might pass by mistake: both implementations must reject (or accept) them identically.
_ODD_VALUES = (0, -1, -4096, True, False, None, 1.5, "4096", 2**64, 2**70)


def _outcome(fn, *args):
    """('ok', result) or ('raise', exception type, message): what a caller observes."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("raise", type(exc).__name__, str(exc))


def _same_error_class(ours, theirs) -> bool:
    return ours[0] == theirs[0] == "raise" and ours[1] == theirs[1]


def _skip_for_oracle(impl, area: str) -> None:
    """Skip where the implementation's module for ``area`` *is* the oracle's module (the reference itself, or a
    plugin that re-exports it): agreement with itself is trivially true. Decided by module identity, never by
    the implementation's name."""
    import reference

    if impl.load(area) is reference.IMPLEMENTATION.load(area):
        pytest.skip(f"{impl.name}'s {area} module is the reference's own: agreement with itself is trivially true")


def _address_limit(impl) -> int | None:
    return impl.capabilities.range_address_limit


def make_registry_agreement(ours_api, reference_api, address_limit: int | None = None):
    class RegistryAgreement(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ours = ours_api.RangeRegistry()
            self.ref = reference_api.RangeRegistry()
            self.starts: list[int] = []

        def _both(self, method: str, *args):
            ours = _outcome(getattr(self.ours, method), *args)
            ref = _outcome(getattr(self.ref, method), *args)
            assert ours == ref, f"{method}{args}: implementation {ours} != reference {ref}"
            return ours

        @rule(
            start=st.integers(0, 2048).map(lambda k: _BASE + 16 * k),
            nbytes=st.integers(1, 300),
            owner=st.integers(0, 2**40),
        )
        def add(self, start: int, nbytes: int, owner: int) -> None:
            if self._both("add", start, nbytes, owner)[0] == "ok":
                self.starts.append(start)

        @rule(data=st.data())
        def add_malformed(self, data) -> None:
            args = [_BASE + 16 * 5000, 16, 0]
            slot = data.draw(st.integers(0, 2))
            args[slot] = data.draw(st.sampled_from(_ODD_VALUES))
            ours = _outcome(self.ours.add, *args)
            ref = _outcome(self.ref.add, *args)
            value = args[slot]
            if (
                address_limit is not None
                and isinstance(value, int)
                and not isinstance(value, bool)
                and value >= address_limit
            ):
                # A declared difference: a registry with bounded words rejects what the reference would store;
                # the error is a ConfigurationError (a ValueError) naming the argument.
                assert ours[0] == "raise" and ours[1] == "ConfigurationError", ours
                if ref[0] == "ok":
                    self.ref.remove(args[0])
                return
            assert ours == ref, f"add{tuple(args)}: implementation {ours} != reference {ref}"
            if ours[0] == "ok":
                self.starts.append(args[0])

        @precondition(lambda self: self.starts)
        @rule(data=st.data())
        def remove(self, data) -> None:
            start = data.draw(st.sampled_from(self.starts))
            if self._both("remove", start)[1]:
                self.starts.remove(start)

        @rule(start=st.one_of(st.integers(-10, _BASE + 16 * 2100), st.sampled_from((0, -1, 2**64, 2**70))))
        def remove_anything(self, start: int) -> None:
            if self._both("remove", start)[1]:
                self.starts.remove(start)

        @rule(data=st.data())
        def probe(self, data) -> None:
            if self.starts and data.draw(st.booleans()):
                start = data.draw(st.sampled_from(self.starts))
                ptr = start + data.draw(st.integers(-2, 300))
            else:
                ptr = data.draw(
                    st.one_of(st.integers(-5, _BASE + 16 * 2100), st.sampled_from((0, 2**64, 2**65)))
                )
            nbytes = data.draw(st.one_of(st.integers(-2, 320), st.sampled_from((2**64, 2**70))))
            self._both("contains", ptr, nbytes)
            self._both("__contains__", (ptr, nbytes))
            if ptr >= 0:
                self._both("find", ptr)

        @invariant()
        def same_contents(self) -> None:
            self._both("ranges")
            self._both("total_bytes")
            self._both("__len__")

    return RegistryAgreement


def test_registry_agrees_with_reference(impl, area_api, reference_api, conformance_property):
    """Every add/remove/probe result and error of its RangeRegistry equals the reference's."""
    _skip_for_oracle(impl, "ranges")
    run_state_machine_as_test(
        make_registry_agreement(area_api, reference_api, _address_limit(impl)), settings=state_machine_settings()
    )
    conformance_property(f"registry agreement runs ({impl.name})", 1)


def test_a_range_ending_at_the_address_limit_agrees_with_reference(impl, area_api, reference_api):
    """Issue 52, defect 2: ``RangeRegistry().add(2**64 - 10, 10)`` -- a range that ends exactly at the top of the
    64-bit address space, which the contract's ``check_range_end`` accepts (``start + nbytes <= 2**64``) -- raised a
    raw RuntimeError from the native registry. At the implementation's declared address limit (2**64 when it
    declares none, the reference's own) a range ending exactly there is stored, found and removed like the
    reference does it: every add, probe, overlap refusal and removal observes the same result. One byte further is
    a ConfigurationError naming ``start + nbytes`` for a bounded registry, never a RuntimeError."""
    _skip_for_oracle(impl, "ranges")
    limit = _address_limit(impl) or 2**64
    ours, ref = area_api.RangeRegistry(), reference_api.RangeRegistry()

    def both(method: str, *args):
        a = _outcome(getattr(ours, method), *args)
        b = _outcome(getattr(ref, method), *args)
        assert a == b, f"{method}{args}: implementation {a} != reference {b}"
        return a

    assert both("add", limit - 10, 10, 7) == ("ok", None)
    both("add", limit - 1, 1)  # overlaps: the same ValueError
    both("add", limit - 20, 11)  # overlaps from below
    assert both("add", limit - 20, 10) == ("ok", None)  # adjacent below it
    for ptr, nbytes in ((limit - 10, 10), (limit - 1, 1), (limit - 1, 0), (limit - 10, 11), (limit - 11, 2),
                        (limit - 5, 2**64), (limit - 20, 20)):
        both("contains", ptr, nbytes)
        both("__contains__", (ptr, nbytes))
    for ptr in (limit - 1, limit - 10, limit - 11, limit - 21):
        both("find", ptr)
    both("ranges")
    both("total_bytes")
    assert both("remove", limit - 10) == ("ok", True)
    both("ranges")
    if _address_limit(impl) is not None:
        past = _outcome(ours.add, limit - 10, 11)
        assert past[:2] == ("raise", "ConfigurationError") and "start + nbytes" in past[2], past


def make_pinning_agreement(ours_pin, ref_pin):
    class PinningAgreement(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # The test runs with the cyclic GC off (see below), so these counters only move by this trace.
            self.base = (ours_pin.pinned_stats(), ref_pin.pinned_stats())
            self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.views: list[tuple[torch.Tensor, torch.Tensor]] = []

        def teardown(self) -> None:
            self.pairs.clear()
            self.views.clear()
            if rule_failed():
                return  # released above; the failing rule's assertion is what gets reported
            after = (ours_pin.pinned_stats(), ref_pin.pinned_stats())
            assert after == self.base, f"stats after the trace {after} != before {self.base}"

        @rule(n=st.integers(0, 3 * 4096), dtype=st.sampled_from((torch.uint8, torch.float32, torch.float64)))
        def pin(self, n: int, dtype: torch.dtype) -> None:
            count = n // torch.empty((), dtype=dtype).element_size()
            self.pairs.append((ours_pin.pin_empty(count, dtype=dtype), ref_pin.pin_empty(count, dtype=dtype)))

        @rule(data=st.data())
        def pin_copy(self, data) -> None:
            shape = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple))
            src = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).view(shape)
            if len(shape) > 1 and data.draw(st.booleans()):
                src = src.transpose(0, -1)
            ours = ours_pin.pin_memory(src, match_shape=data.draw(st.booleans()))
            ref = ref_pin.pin_memory(src, match_shape=ours.dim() == src.dim())
            assert ours.shape == ref.shape and torch.equal(ours, ref)
            self.pairs.append((ours, ref))

        @precondition(lambda self: self.pairs)
        @rule(data=st.data())
        def view(self, data) -> None:
            ours, ref = self.pairs[data.draw(st.integers(0, len(self.pairs) - 1))]
            o, r = ours.view(-1), ref.view(-1)
            if o.numel() == 0:
                return
            start = data.draw(st.integers(0, o.numel() - 1))
            length = data.draw(st.integers(0, o.numel() - start))
            step = data.draw(st.integers(1, 3))
            self.views.append((o[start : start + length : step], r[start : start + length : step]))

        @precondition(lambda self: self.pairs or self.views)
        @rule(data=st.data())
        def unpin(self, data) -> None:
            both = self.pairs + self.views
            ours, ref = both[data.draw(st.integers(0, len(both) - 1))]  # an index: hypothesis keeps no tensor
            a, b = ours_pin.unpin(ours), ref_pin.unpin(ref)
            assert a == b, f"unpin: implementation {a} != reference {b}"

        @precondition(lambda self: self.pairs or self.views)
        @rule(data=st.data())
        def lookup(self, data) -> None:
            both = self.pairs + self.views
            ours, ref = both[data.draw(st.integers(0, len(both) - 1))]  # an index: hypothesis keeps no tensor
            a, b = ours_pin.is_pinned(ours), ref_pin.is_pinned(ref)
            assert a == b, f"is_pinned(shape {tuple(ours.shape)}): implementation {a} != reference {b}"

        @precondition(lambda self: self.pairs)
        @rule(data=st.data())
        def drop(self, data) -> None:
            self.pairs.pop(data.draw(st.integers(0, len(self.pairs) - 1)))

        @precondition(lambda self: self.views)
        @rule(data=st.data())
        def drop_view(self, data) -> None:
            self.views.pop(data.draw(st.integers(0, len(self.views) - 1)))

        @invariant()
        def same_stat_deltas(self) -> None:
            ours = [a - b for a, b in zip(ours_pin.pinned_stats(), self.base[0], strict=True)]
            ref = [a - b for a, b in zip(ref_pin.pinned_stats(), self.base[1], strict=True)]
            assert ours == ref, f"pinned_stats deltas: implementation {ours} != reference {ref}"

    return PinningAgreement


@pytest.mark.requires(pin_backends="native", areas=("pinning",))
def test_native_pinning_agrees_with_reference(impl, accelerator, conformance_property, monkeypatch):
    """The same native-pinning trace gives the same is_pinned/unpin results and pinned_stats deltas."""
    _skip_for_oracle(impl, "pinning")
    import reference

    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    os.environ.pop("HOSTOFFLOAD_PIN_REGISTER_DEVICE", None)
    machine = make_pinning_agreement(impl.load("pinning"), reference.IMPLEMENTATION.load("pinning"))
    # Every example locks real pages on both sides, so the state-machine count is capped at 100 (the registry
    # machine above runs the profile's full count). The cyclic GC is paused so that garbage left by earlier
    # tests cannot be collected mid-trace and move one side's counters; the trace itself creates no cycles
    # (rules draw indices, never tensors, so hypothesis holds no buffer), reference counting frees them.
    base = state_machine_settings()
    gc.collect()
    gc.disable()
    try:
        run_state_machine_as_test(machine, settings=settings(base, max_examples=min(base.max_examples, 100)))
    finally:
        gc.enable()
    conformance_property(f"pinning agreement runs ({impl.name})", 1)

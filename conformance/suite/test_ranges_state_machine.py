"""The range registry against a plain model, as hypothesis state machines run on every implementation.

Two machines share one model (a dict of start -> (nbytes, owner)):

- ``RegistryMachine`` drives a private ``RangeRegistry`` with synthetic addresses: adds (overlapping ones must be
  rejected), removes, and containment probes placed on and around range edges, where off-by-one bugs live.
- ``PinningMachine`` drives real native pinned memory through the pinning area: allocate, view, narrow, unpin,
  drop, look up. Its model tracks which allocations are alive and pinned, and checks the process-wide registry.

Invariants after every step: ranges are sorted and never overlap, byte totals match the model, freed or unpinned
ranges are never found, live views of pinned allocations are always found.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from conformance.areas.stateful import rule_failed
from conformance.harness.profiles import state_machine_settings

pytestmark = pytest.mark.conformance_area("ranges")

_BASE = 1 << 20  # synthetic addresses start here (0 is never a valid start)


def _contains_model(model: dict[int, tuple[int, int]], ptr: int, nbytes: int) -> bool:
    if ptr <= 0 or nbytes < 0:
        return False
    for start, (size, _owner) in model.items():
        if start <= ptr < start + size:
            return ptr + nbytes <= start + size
    return False


def _check_structure(registry, model: dict[int, tuple[int, int]]) -> None:
    snapshot = [(r.start, r.nbytes, r.owner) for r in registry.ranges()]
    expected = sorted((s, n, o) for s, (n, o) in model.items())
    assert snapshot == expected, f"registry ranges {snapshot} != model {expected}"
    for (s1, n1, _), (s2, _, _) in itertools.pairwise(snapshot):
        assert s1 + n1 <= s2, f"ranges overlap: [{s1:#x}, +{n1}) and [{s2:#x}, ...)"
    assert registry.total_bytes() == sum(n for n, _ in model.values())
    assert len(registry) == len(model)


def make_registry_machine(ranges_api, counter):
    class RegistryMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.registry = ranges_api.RangeRegistry()
            self.model: dict[int, tuple[int, int]] = {}

        @rule(start=st.integers(0, 4096).map(lambda k: _BASE + 16 * k), nbytes=st.integers(1, 256),
              owner=st.integers(0, 2**31))
        def add(self, start: int, nbytes: int, owner: int) -> None:
            overlaps = any(s < start + nbytes and start < s + n for s, (n, _) in self.model.items())
            if overlaps:
                with pytest.raises(ValueError):
                    self.registry.add(start, nbytes, owner)
            else:
                self.registry.add(start, nbytes, owner)
                self.model[start] = (nbytes, owner)

        @precondition(lambda self: self.model)
        @rule(data=st.data())
        def remove_existing(self, data) -> None:
            start = data.draw(st.sampled_from(sorted(self.model)))
            assert self.registry.remove(start) is True
            del self.model[start]

        @rule(start=st.integers(0, 4096).map(lambda k: _BASE + 16 * k + 1))
        def remove_missing(self, start: int) -> None:
            # Odd addresses are never starts (every start above is a multiple of 16).
            assert self.registry.remove(start) is False

        @rule(data=st.data())
        def probe(self, data) -> None:
            if self.model and data.draw(st.booleans()):
                start = data.draw(st.sampled_from(sorted(self.model)))
                size = self.model[start][0]
                ptr = start + data.draw(st.sampled_from((-1, 0, 1, size - 1, size, size + 1)))
                nbytes = data.draw(st.sampled_from((0, 1, size - 1, size, size + 1)))
            else:
                ptr = data.draw(st.integers(0, _BASE + 16 * 4200))
                nbytes = data.draw(st.integers(0, 512))
            expected = _contains_model(self.model, ptr, nbytes)
            got = self.registry.contains(ptr, nbytes)
            assert got == expected, f"contains({ptr:#x}, {nbytes}) = {got}, model says {expected}"
            found = self.registry.find(ptr)
            owner_of = next((s for s, (n, _) in self.model.items() if s <= ptr < s + n), None)
            assert (found.start if found else None) == owner_of, f"find({ptr:#x}) = {found}, model {owner_of}"

        @invariant()
        def structure(self) -> None:
            counter("registry state-machine steps", 1)
            _check_structure(self.registry, self.model)

    return RegistryMachine


def make_pinning_machine(pinning_api, ranges_api, counter):
    registry = ranges_api.global_registry()

    class PinningMachine(RuleBasedStateMachine):
        # Bundles hold integer keys only: the machine must be able to drop every tensor in teardown, and
        # hypothesis keeps bundle values alive for its own reporting.
        allocations = Bundle("allocations")
        views = Bundle("views")

        def __init__(self) -> None:
            super().__init__()
            # No gc.collect() here: tensors free their storage by reference counting, and a full collection
            # costs ~0.2 s with torch loaded, which would dominate a 20 000-step run.
            self.baseline = {(r.start, r.nbytes) for r in registry.ranges()}
            # live allocation key -> [base tensor (None once dropped), pinned?, data_ptr, requested bytes]
            self.alive: dict[int, list] = {}
            self.view_tensors: dict[int, tuple[int, torch.Tensor]] = {}
            self.next_key = 0

        def _key(self) -> int:
            self.next_key += 1
            return self.next_key

        def teardown(self) -> None:
            self.alive.clear()
            self.view_tensors.clear()
            leftover = {(r.start, r.nbytes) for r in registry.ranges()} - self.baseline
            if leftover:  # only a reference cycle could delay the release; give the collector its chance
                gc.collect()
                leftover = {(r.start, r.nbytes) for r in registry.ranges()} - self.baseline
            if rule_failed():
                return  # everything is released above; the rule's own assertion is what gets reported
            assert not leftover, f"ranges left registered after every view died: {sorted(leftover)}"

        @rule(target=allocations, n=st.integers(1, 3 * 4096), dtype=st.sampled_from((torch.uint8, torch.float32)))
        def alloc(self, n: int, dtype: torch.dtype) -> int:
            t = pinning_api.pin_empty(n, dtype=dtype)
            key = self._key()
            self.alive[key] = [t, True, t.data_ptr(), t.numel() * t.element_size()]
            return key

        @rule(target=views, key=allocations, data=st.data())
        def view(self, key: int, data) -> int:
            entry = self.alive.get(key)
            if entry is None or entry[0] is None:
                return -1
            base = entry[0].view(-1)
            n = base.numel()
            start = data.draw(st.integers(0, n - 1))
            length = data.draw(st.integers(1, n - start))
            kind = data.draw(st.sampled_from(("narrow", "slice", "step")))
            if kind == "narrow":
                v = base.narrow(0, start, length)
            elif kind == "slice":
                v = base[start : start + length]
            else:
                v = base[start :: data.draw(st.integers(1, 5))]
            vkey = self._key()
            self.view_tensors[vkey] = (key, v)
            return vkey

        @rule(key=allocations)
        def unpin(self, key: int) -> None:
            entry = self.alive.get(key)
            if entry is None or entry[0] is None:
                return
            expected = entry[1]
            got = pinning_api.unpin(entry[0])
            assert got is expected, f"unpin returned {got}, model says {expected}"
            entry[1] = False

        def _release_if_unreferenced(self, key: int) -> None:
            """Model of the lifetime rule: the allocation (and its range) dies with its last tensor."""
            entry = self.alive.get(key)
            if entry is not None and entry[0] is None and all(k != key for k, _ in self.view_tensors.values()):
                del self.alive[key]

        @rule(key=consumes(allocations))
        def drop(self, key: int) -> None:
            if key in self.alive:
                self.alive[key][0] = None  # views may still hold the allocation alive
                self._release_if_unreferenced(key)

        @rule(vkey=consumes(views))
        def drop_view(self, vkey: int) -> None:
            owner = self.view_tensors.pop(vkey, (None, None))[0]
            if owner is not None:
                self._release_if_unreferenced(owner)

        @rule(vkey=views)
        def lookup_view(self, vkey: int) -> None:
            if vkey not in self.view_tensors:
                return
            key, tensor = self.view_tensors[vkey]
            expected = self.alive[key][1]
            got = pinning_api.is_pinned(tensor)
            assert got is expected, f"view of allocation {key} (pinned={expected}): is_pinned={got}"

        @invariant()
        def registry_matches_model(self) -> None:
            counter("pinning state-machine steps", 1)
            current = {(r.start, r.nbytes) for r in registry.ranges()} - self.baseline
            starts = {s for s, _ in current}
            pinned = {e[2] for e in self.alive.values() if e[1]}
            assert pinned <= starts, f"pinned allocations missing from the registry: {sorted(pinned - starts)}"
            unpinned = {e[2] for e in self.alive.values() if not e[1]}
            assert not (unpinned & starts), f"unpinned allocations still registered: {sorted(unpinned & starts)}"
            sizes = {e[2]: e[3] for e in self.alive.values()}
            ordered = sorted(current)
            for (s1, n1), nxt in zip(ordered, [*ordered[1:], (None, None)], strict=False):
                assert n1 >= sizes.get(s1, 0), f"range at {s1:#x} is smaller than its allocation"
                assert nxt[0] is None or s1 + n1 <= nxt[0], "registered ranges overlap"

    return PinningMachine


def test_registry_state_machine(impl, area_api, conformance_property):
    """Registry vs model over add/remove/probe sequences (the full-extent rule, edges included)."""
    from hypothesis.stateful import run_state_machine_as_test

    machine = make_registry_machine(area_api, conformance_property)
    run_state_machine_as_test(machine, settings=state_machine_settings())


@pytest.mark.requires(pin_backends="native")
@pytest.mark.requires(areas=("pinning",))
def test_pinning_state_machine(impl, area_api, accelerator, conformance_property, monkeypatch):
    """alloc / view / narrow / unpin / drop / lookup through native pinning vs a model of the registry."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    os.environ.pop("HOSTOFFLOAD_PIN_REGISTER_DEVICE", None)
    from hypothesis.stateful import run_state_machine_as_test

    machine = make_pinning_machine(impl.load("pinning"), area_api, conformance_property)
    run_state_machine_as_test(machine, settings=state_machine_settings())

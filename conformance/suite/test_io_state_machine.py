"""Swap I/O against a plain model: a hypothesis state machine of write / read / wait on one handle.

The model is a dict of files, each a byte length and a dict of records (slot -> dtype and payload bytes), updated
when a request is *submitted*: requests on one path take effect in submission order, so the model never needs to
know when the handle actually runs them. Each request carries its expected outcome (the bytes a read must
deliver, or the error class ``wait()`` must raise), checked whenever the machine waits on it, alone
(``request.wait()``) or all at once (``handle.wait()``, which must raise the earliest unreported failure).

Slots are placed :func:`record_span` apart (one at an unaligned offset, so buffered and O_DIRECT requests mix)
and never overlap. One path lives in a directory that does not exist. Runs on every implementation providing
"io", with pageable, pinned and narrowed-pinned tensors from that implementation's pinning area.
"""

from __future__ import annotations

import gc
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from conformance.areas.io_assertions import assert_bytes_equal, assert_no_new_threads, raw_bytes, thread_baseline
from conformance.areas.io_strategies import handle_configs
from conformance.areas.stateful import rule_failed
from conformance.areas.strategies import DTYPES, filled
from conformance.harness.profiles import state_machine_settings
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")

PATHS = ("a.bin", "b.bin", "c.bin", "missing-dir/x.bin")
MAX_NUMEL = 2000


def make_machine(api, pinning, base_dir, counter):
    header = api.HEADER_SIZE
    span = api.record_span(MAX_NUMEL * 8)
    slot_offsets = (0, span, 2 * span + 100, 3 * span)  # slot 2 is unaligned: never O_DIRECT

    class IOMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = tempfile.mkdtemp(dir=base_dir)
            self.handle = None
            self.files: dict[str, dict] = {}
            self.outstanding: list[tuple[object, tuple]] = []  # (request, expectation), submission order
            self.steps = 0
            self.order: dict[object, int] = {}  # request -> submission number

        @initialize(config=handle_configs())
        def open_handle(self, config) -> None:
            self.handle = api.SwapHandle(**config)

        def _path(self, name: str) -> str:
            return f"{self.dir}/{name}"

        def _tensor(self, kind: str, dtype, numel: int, seed: int, fill: bool) -> torch.Tensor:
            values = filled((numel,), dtype, seed) if fill else torch.zeros(numel, dtype=dtype)
            if kind == "pageable":
                return values
            if kind == "pinned":
                t = pinning.pin_empty(numel, dtype=dtype)
            else:
                t = pinning.pin_empty(numel + 7, dtype=dtype)[3 : 3 + numel]
            t.copy_(values)
            return t

        @rule(name=st.sampled_from(PATHS), slot=st.integers(0, 3), dtype=st.sampled_from(DTYPES),
              numel=st.integers(0, MAX_NUMEL), seed=st.integers(0, 2**16),
              kind=st.sampled_from(("pageable", "pinned", "pinned-narrow")))
        def write(self, name, slot, dtype, numel, seed, kind) -> None:
            self.steps += 1
            t = self._tensor(kind, dtype, numel, seed, fill=True)
            off = slot_offsets[slot]
            req = self.handle.write(t, self._path(name), off)
            self.order[req] = len(self.order)
            if name.startswith("missing-dir/"):
                self.outstanding.append((req, ("error", "SwapFileNotFoundError")))
                return
            payload = raw_bytes(t)
            f = self.files.setdefault(name, {"length": 0, "records": {}})
            f["records"][slot] = (dtype, payload)
            f["length"] = max(f["length"], off + header + len(payload))
            self.outstanding.append((req, ("ok", None, None)))

        def _expect_read(self, name: str, slot: int, dtype, nbytes: int) -> tuple:
            f = self.files.get(name)
            if f is None:
                return ("error", "SwapFileNotFoundError")
            off = slot_offsets[slot]
            if f["length"] < off + header:
                return ("error", "ShortFileError")
            rec = f["records"].get(slot)
            if rec is None:
                return ("error", "RecordFormatError")
            if rec[0] != dtype:
                return ("error", "DtypeMismatchError")
            if len(rec[1]) != nbytes:
                return ("error", "SizeMismatchError")
            return ("ok", rec[1], None)

        @rule(name=st.sampled_from(PATHS), slot=st.integers(0, 3), dtype=st.sampled_from(DTYPES),
              numel=st.integers(0, MAX_NUMEL), kind=st.sampled_from(("pageable", "pinned", "pinned-narrow")),
              data=st.data())
        def read(self, name, slot, dtype, numel, kind, data) -> None:
            self.steps += 1
            rec = self.files.get(name, {}).get("records", {}).get(slot)
            if rec is not None and data.draw(st.booleans(), label="matching dtype and size"):
                dtype = rec[0]
                numel = len(rec[1]) // torch.empty((), dtype=dtype).element_size()
            t = self._tensor(kind, dtype, numel, 0, fill=False)
            expectation = self._expect_read(name, slot, dtype, numel * t.element_size())
            req = self.handle.read(t, self._path(name), slot_offsets[slot])
            self.order[req] = len(self.order)
            if expectation[0] == "ok":
                expectation = ("ok", expectation[1], t)
            self.outstanding.append((req, expectation))

        def _check(self, req, expectation, exc) -> None:
            if expectation[0] == "error":
                cls = getattr(api, expectation[1])
                assert isinstance(exc, cls), f"{req!r}: expected {expectation[1]}, got {type(exc).__name__}: {exc}"
                assert exc.request is req
                return
            assert exc is None, f"{req!r}: expected success, got {type(exc).__name__}: {exc}"
            _, payload, tensor = expectation
            if tensor is not None:
                assert_bytes_equal(raw_bytes(tensor), payload, f"{req!r} read back")

        @rule(data=st.data())
        def wait_one(self, data) -> None:
            if not self.outstanding:
                return
            self.steps += 1
            i = data.draw(st.integers(0, len(self.outstanding) - 1), label="request")
            req, expectation = self.outstanding.pop(i)
            try:
                req.wait()
                exc = None
            except Exception as e:  # checked against the expectation
                exc = e
            self._check(req, expectation, exc)

        @rule()
        def wait_all(self) -> None:
            self.steps += 1
            # Failures not yet raised are exactly the outstanding requests expected to fail: wait_one reports one.
            failing = [r for r, e in self.outstanding if e[0] == "error"]
            first_expected = min(failing, key=self.order.__getitem__, default=None)
            try:
                self.handle.wait()
                raised = None
            except Exception as e:  # checked below
                raised = e
            if first_expected is None:
                assert raised is None, f"handle.wait() raised {type(raised).__name__}: {raised}; nothing failed"
            else:
                assert raised is not None and raised.request is first_expected, (
                    f"handle.wait() raised {raised!r}, expected the error of {first_expected!r}"
                )
            for req, expectation in self.outstanding:
                assert req.done(), f"{req!r} not done after handle.wait()"
                self._check(req, expectation, req.exception())
            self.outstanding = []

        @rule()
        def stats_add_up(self) -> None:
            s = self.handle.stats()
            assert s.direct_bytes + s.bounced_bytes == s.bytes_written + s.bytes_read, s
            assert s.requests <= s.requests + s.in_flight

        def teardown(self) -> None:
            try:
                if self.handle is not None:
                    failed = rule_failed()  # then release only: the rule's assertion is what gets reported
                    for req, expectation in self.outstanding:
                        exc = req.exception()
                        if not failed:
                            self._check(req, expectation, exc)
                    try:
                        self.handle.wait()
                    except Exception:  # every outstanding failure was checked above
                        pass
                    self.handle.close()
                    s = self.handle.stats()
                    if not failed:
                        assert (s.threads, s.bounce_in_use, s.pool_bytes, s.in_flight) == (0, 0, 0, 0), s
            finally:
                counter("io state-machine steps", self.steps)
                shutil.rmtree(self.dir, ignore_errors=True)

    return IOMachine


@pytest.mark.requires(areas=("pinning",))
def test_io_state_machine(impl, area_api, accelerator, conformance_property, tmp_path, monkeypatch):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    pinning = impl.load("pinning")
    threads0 = thread_baseline()
    pinned0 = pinning.pinned_stats()
    machine = make_machine(area_api, pinning, str(tmp_path), conformance_property)
    from hypothesis.stateful import run_state_machine_as_test

    base = state_machine_settings()
    # Every step is real file I/O (and pinned allocations), unlike the in-memory registry machines the profile's
    # state-machine count is sized for; a quarter of it keeps this test under ~10 s per implementation on CI.
    run_state_machine_as_test(machine, settings=settings(base, max_examples=max(10, base.max_examples // 4)))
    gc.collect()
    assert_no_new_threads(threads0, "after the state machine")
    assert pinning.pinned_stats() == pinned0

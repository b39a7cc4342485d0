"""Contention: eight threads pinning, viewing, looking up, unpinning and dropping at once.

The registry and the pinned-memory accounting are process-wide and shared by every thread, so their invariants
must survive interleavings no sequential test produces: a lookup racing an unpin of a *different* allocation,
a range dropped by one thread while another thread's view of a neighbouring buffer is probed, deleters running
on whichever thread drops the last view. Each thread owns its allocations, so what it observes about them is
deterministic and is checked on every step; after the threads join, the registry must equal the model (nothing
but the baseline) and pinned bytes, allocation counts and VmLck must be back at their starting values.

The races run for every pinning backend the implementation declares (the suite's ``pin_backend`` fixture), since
an implementation's table may sit behind either, and with the interpreter switching threads every few
microseconds (:func:`frequent_thread_switches`): a table updated without its lock by Python code (read, change,
publish) loses an update only when a switch falls inside that window, which the default 5 ms interval makes rare.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.assertions import assert_names_argument, vm_locked_kib

pytestmark = pytest.mark.conformance_area("pinning")

THREADS = 8
OPS_PER_THREAD = 150
MAX_BYTES = 3 * 4096 + 17


#: Seconds between forced thread switches while a race runs (the interpreter's default is 0.005).
SWITCH_INTERVAL_S = 1e-6


@contextlib.contextmanager
def frequent_thread_switches() -> Iterator[None]:
    """The interpreter hands the GIL to another thread every :data:`SWITCH_INTERVAL_S`, so unlocked
    read-change-publish sequences in Python code interleave as often as native threads would."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class _Worker(threading.Thread):
    """Runs a seeded random sequence of pinning operations on its own allocations and checks each outcome.

    ``pins``: whether this backend's memory is pinned on this accelerator (the torch backend on a CPU-only build
    is a documented no-op); ``unpinnable``: whether ``unpin`` releases it (only native memory: torch owns its
    own). The registry, when the implementation exposes one, is checked against the model for native memory."""

    def __init__(self, api, registry, seed: int, barrier: threading.Barrier, *, pins: bool, unpinnable: bool) -> None:
        super().__init__(name=f"pin-worker-{seed}")
        self.api = api
        self.registry = registry
        self.pins = pins
        self.unpinnable = unpinnable
        self.rng = random.Random(seed)
        self.barrier = barrier
        self.error: BaseException | None = None
        self.ops: dict[str, int] = {}

    def _check(self, condition: bool, message: str) -> None:
        if not condition:
            raise AssertionError(f"{self.name}: {message}")

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=60)
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _run(self) -> None:
        api, rng = self.api, self.rng
        live: list[list] = []  # [tensor, pinned, (start, nbytes) of the whole buffer]
        views: list[tuple[list, torch.Tensor, torch.Tensor]] = []  # (owner, view, bytes at view time)
        for _ in range(OPS_PER_THREAD):
            op = rng.choice(("pin", "pin", "view", "lookup", "lookup", "unpin", "drop", "drop_view", "copy"))
            if op in ("view", "lookup", "unpin", "drop", "copy") and not live:
                op = "pin"
            self.ops[op] = self.ops.get(op, 0) + 1
            if op == "pin":
                n = rng.randint(1, MAX_BYTES)
                t = api.pin_empty(n, dtype=torch.uint8)
                t.fill_(len(live) % 251)
                self._check(api.is_pinned(t) is self.pins, f"is_pinned(fresh pin_empty({n})) != {self.pins}")
                live.append([t, self.pins, (t.data_ptr(), n)])
            elif op == "copy":
                entry = rng.choice(live)
                src = torch.arange(entry[0].numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
                out = api.pin_memory(src)
                self._check(torch.equal(out, src), "pin_memory copy differs from its source")
                self._check(api.is_pinned(out) is self.pins, f"is_pinned(pin_memory result) != {self.pins}")
                live.append([out, self.pins, (out.data_ptr(), out.numel())])
            elif op == "view":
                entry = rng.choice(live)
                base = entry[0]
                start = rng.randrange(base.numel())
                length = rng.randint(1, base.numel() - start)
                v = base[start : start + length]
                views.append((entry, v, v.clone()))
            elif op == "lookup":
                entry = rng.choice(live)
                self._check(api.is_pinned(entry[0]) is entry[1], f"is_pinned(buffer) != model ({entry[1]})")
                ptr, nbytes = entry[2]
                if self.registry is not None and self.unpinnable:
                    self._check(
                        self.registry.contains(ptr, nbytes) is entry[1],
                        f"registry.contains({ptr:#x}, {nbytes}) != model ({entry[1]})",
                    )
                for owner, v, _ in views[-4:]:
                    self._check(api.is_pinned(v) is owner[1], f"is_pinned(view) != model ({owner[1]})")
            elif op == "unpin":
                entry = rng.choice(live)
                target = entry[0]
                got = api.unpin(target)
                expected = entry[1] and self.unpinnable
                self._check(got is expected, f"unpin returned {got}, model says {expected}")
                entry[1] = entry[1] and not self.unpinnable
                self._check(api.is_pinned(target) is entry[1], f"is_pinned after unpin != model ({entry[1]})")
            elif op == "drop":
                live.pop(rng.randrange(len(live)))
            elif op == "drop_view" and views:
                views.pop(rng.randrange(len(views)))
        # Views must still read their buffer's bytes, pinned or not, whatever happened in other threads.
        for _, v, expected in views:
            self._check(torch.equal(v, expected), "a surviving view reads changed bytes")
        live.clear()
        views.clear()


def _registry_of(impl):
    return impl.load("ranges").global_registry() if impl.provides("ranges") else None


def _snapshot(api, registry) -> tuple:
    gc.collect()
    ranges = sorted((r.start, r.nbytes) for r in registry.ranges()) if registry is not None else []
    return api.pinned_stats(), ranges, vm_locked_kib()


# Each example runs 8 threads x 150 operations that lock real pages: a handful of examples already produces
# thousands of interleaved operations, so the profile's example count is capped here.
@settings(max_examples=5)
@given(seed=st.integers(0, 2**32 - 1))
def test_eight_threads_pin_view_lookup_unpin_drop(
    impl, area_api, accelerator, pin_backend, backend_pins, conformance_property, seed
):
    registry = _registry_of(impl)
    stats0, ranges0, locked0 = _snapshot(area_api, registry)
    barrier = threading.Barrier(THREADS)
    workers = [
        _Worker(area_api, registry, seed * THREADS + i, barrier, pins=backend_pins,
                unpinnable=pin_backend == "native")
        for i in range(THREADS)
    ]
    with frequent_thread_switches():
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=600)
    hung = [w.name for w in workers if w.is_alive()]
    assert not hung, f"threads did not finish: {hung}"
    errors = [w.error for w in workers if w.error is not None]
    if errors:
        raise errors[0]
    del workers
    stats1, ranges1, locked1 = _snapshot(area_api, registry)
    assert ranges1 == ranges0, (
        f"registry differs from the model after the threads joined: "
        f"extra {sorted(set(ranges1) - set(ranges0))}, "
        f"missing {sorted(set(ranges0) - set(ranges1))}"
    )
    assert stats1 == stats0, f"pinned_stats not back to the start: before {stats0}, after {stats1}"
    if pin_backend == "native" or not accelerator.has_torch_pinning:  # torch's cache keeps its pages locked
        assert locked1 == locked0, f"VmLck not back to the start: before {locked0} KiB, after {locked1} KiB"
    conformance_property(f"contention operations ({impl.name})", THREADS * OPS_PER_THREAD)


def test_lookups_never_miss_while_other_threads_churn(impl, area_api, accelerator, pin_backend, backend_pins):
    """Readers probing a buffer that stays pinned must see it pinned on every probe while writers add and
    remove neighbouring buffers (a torn, half-published or lost-update table would make a probe miss)."""
    stable = area_api.pin_empty(4096 * 2, dtype=torch.uint8)
    views = [stable[i * 512 : i * 512 + 700] for i in range(8)]
    stop = threading.Event()
    misses: list[str] = []

    def reader() -> None:
        n = 0
        while not stop.is_set() or n < 200:
            for v in views:
                if area_api.is_pinned(v) is not backend_pins:
                    misses.append(f"view at {v.data_ptr():#x}: is_pinned != {backend_pins}")
            n += 1

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            t = area_api.pin_empty(rng.randint(1, 20000), dtype=torch.uint8)
            if rng.random() < 0.5:
                area_api.unpin(t)
            del t

    readers = [threading.Thread(target=reader) for _ in range(4)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    with frequent_thread_switches():
        for th in readers + writers:
            th.start()
        for th in writers:
            th.join(timeout=300)
        stop.set()
        for th in readers:
            th.join(timeout=300)
    assert not misses, f"{len(misses)} lookups of a pinned buffer missed, first: {misses[0]}"
    assert area_api.unpin(stable) is (pin_backend == "native")


#: Buffers each thread pins (and then unpins) in the lost-update race.
BURST = 250


def test_simultaneous_pins_and_unpins_are_all_recorded(area_api, pin_backend, backend_pins):
    """Eight threads pin at once, then unpin at once: every buffer is recognised afterwards, and every unpinned
    one is no longer. Pins and unpins that all update one table at the same time are where an update made
    without the table's lock (read the table, change it, publish it) is lost: a buffer then reads unpinned, or
    an unpinned one still pinned."""
    unpinnable = pin_backend == "native"
    barrier = threading.Barrier(THREADS)
    mine: list[list[torch.Tensor]] = [[] for _ in range(THREADS)]
    wrong: list[str] = []

    def burst(k: int) -> None:
        try:
            barrier.wait(timeout=60)
            for _ in range(BURST):
                mine[k].append(area_api.pin_empty(1 + k, dtype=torch.uint8))
            barrier.wait(timeout=60)
            for t in mine[k][::2]:
                if area_api.unpin(t) is not unpinnable:
                    wrong.append(f"thread {k}: unpin of a live buffer did not answer {unpinnable}")
        except BaseException as exc:  # reported by the main thread
            wrong.append(f"thread {k}: {type(exc).__name__}: {exc}")

    with frequent_thread_switches():
        threads = [threading.Thread(target=burst, args=(k,)) for k in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
    for k, buffers in enumerate(mine):
        for i, t in enumerate(buffers):
            expected = backend_pins and not (unpinnable and i % 2 == 0)
            if area_api.is_pinned(t) is not expected:
                wrong.append(f"thread {k}, buffer {i} ({'unpinned' if i % 2 == 0 else 'kept'}): "
                             f"is_pinned != {expected}")
    assert not wrong, f"{len(wrong)} wrong answers after simultaneous pins and unpins, first: {wrong[:3]}"


@pytest.mark.requires("pinned_slab")
def test_slab_pieces_under_contention(impl, area_api, accelerator):
    """Eight threads carve, fill, check and free pieces of one pinned slab (capability ``pinned_slab``).

    Live pieces never overlap (each thread's bytes survive the others' writes), every piece is recognised by
    ``is_pinned`` and refused by ``unpin`` (the slab owns the pin), and once every piece is freed the slab is
    whole again: one free run, nothing used.
    """
    module = impl.capabilities.pinned_slab
    import importlib

    from reference.contract.errors import ConfigurationError

    slab_cls = importlib.import_module(module).PinnedSlab
    gc.collect()
    stats0 = area_api.pinned_stats()
    slab = slab_cls(1 << 20, alignment=64)
    failures: list[str] = []
    barrier = threading.Barrier(THREADS)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[torch.Tensor, int]] = []
        try:
            barrier.wait(timeout=60)
            for step in range(300):
                if mine and (rng.random() < 0.45 or len(mine) > 12):
                    piece, tag = mine.pop(rng.randrange(len(mine)))
                    if not bool((piece == tag).all()):
                        failures.append(f"thread {seed}: piece {piece.data_ptr():#x} was overwritten")
                    slab.free(piece)
                    continue
                try:
                    piece = slab.allocate(
                        rng.randint(1, 8192), dtype=torch.uint8, alignment=rng.choice((1, 64, 4096))
                    )
                except MemoryError:
                    continue
                tag = (seed * 31 + step) % 251
                piece.fill_(tag)
                if not area_api.is_pinned(piece):
                    failures.append(f"thread {seed}: a slab piece is not pinned")
                if area_api.unpin(piece) is not False:
                    failures.append(f"thread {seed}: unpin of a slab piece did not return False")
                mine.append((piece, tag))
            for piece, tag in mine:
                if not bool((piece == tag).all()):
                    failures.append(f"thread {seed}: piece {piece.data_ptr():#x} was overwritten")
                slab.free(piece)
        except BaseException as exc:  # reported by the main thread
            failures.append(f"thread {seed}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not failures, f"{len(failures)} failures, first: {failures[0]}"
    s = slab.stats()
    assert (s.pieces, s.used, s.free, s.free_blocks) == (0, 0, s.capacity, 1), f"slab not whole again: {s}"
    extra = slab.allocate(16, dtype=torch.uint8)
    slab.free(extra)
    with pytest.raises(ConfigurationError) as info:
        slab.free(extra)
    assert_names_argument(info.value, "piece")
    del info  # its traceback (slab.free's frame) holds the piece alive, and with it the slab's allocation
    assert slab.close() is True and slab.close() is False
    assert not area_api.is_pinned(extra), "a closed slab's pieces must no longer be pinned"
    slab = extra = None  # drop the last references: the allocation must go with them
    gc.collect()
    assert area_api.pinned_stats() == stats0, "the slab's allocation outlived its last piece"


_SHUTDOWN_PROBE = """
import os, sys, threading
os.environ["HOSTOFFLOAD_PIN_BACKEND"] = "native"
import importlib
api = importlib.import_module(sys.argv[1])
import torch
# 1. The last view dies on another thread: the release runs there.
t = api.pin_empty(1 << 20, dtype=torch.uint8)
holder = [t[100:200]]
del t
worker = threading.Thread(target=holder.clear)
worker.start()
worker.join()
assert api.pinned_stats().allocations == 0, api.pinned_stats()
# 2. Buffers still alive at interpreter exit: a module global, a reference cycle, an unpinned survivor.
KEEP = api.pin_empty(3, 4096, dtype=torch.float32)
class Node:
    pass
n = Node(); n.self = n; n.t = api.pin_empty(5000, dtype=torch.uint8)
SURVIVOR = api.pin_empty(64, dtype=torch.uint8)[3:9]
api.unpin(SURVIVOR)
print("probe-ok", flush=True)
"""


@pytest.mark.requires(pin_backends="native")
def test_release_on_other_threads_and_at_shutdown(impl, accelerator):
    """The last view may die on any thread, or only at interpreter shutdown: no crash, no error output."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HOSTOFFLOAD_ACCELERATOR": accelerator.name}
    proc = subprocess.run(
        [sys.executable, "-c", _SHUTDOWN_PROBE, impl.areas["pinning"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"probe exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "probe-ok" in proc.stdout, proc.stdout
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.requires(pin_backends="native")
def test_registration_hook_undone_once_from_any_thread(impl, area_api, accelerator, monkeypatch):
    """With an accelerator that registers host memory through its Python hook, every registration is undone
    exactly once, before the pages are unlocked: by ``unpin``, or by the last view dying on another thread.

    The accelerator's hooks are replaced by recording ones (on CPU this turns registration on), so the test
    runs on every machine.
    """
    from conformance.areas.assertions import vm_locked_kib

    cls = type(accelerator)
    calls: list[tuple[str, int, int]] = []  # (event, ptr, VmLck KiB at the time)
    lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> bool:
        with lock:
            calls.append(("register", ptr, vm_locked_kib()))
        return True

    def unregister(self, ptr: int) -> None:
        with lock:
            calls.append(("unregister", ptr, vm_locked_kib()))

    monkeypatch.setattr(cls, "supports_host_registration", property(lambda self: True))
    monkeypatch.setattr(cls, "register_host_memory", register)
    monkeypatch.setattr(cls, "unregister_host_memory", unregister)
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.delenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", raising=False)
    gc.collect()
    s0 = area_api.pinned_stats()
    size = 64 * 4096
    a = area_api.pin_empty(size, dtype=torch.uint8)
    b = area_api.pin_empty(size, dtype=torch.uint8)
    pa, pb = a.data_ptr(), b.data_ptr()
    assert area_api.pinned_stats().registered_bytes - s0.registered_bytes == 2 * size
    locked_with_both = vm_locked_kib()
    assert area_api.unpin(a) is True and area_api.unpin(a) is False
    holder = [b[10:20]]
    del b
    th = threading.Thread(target=holder.clear)
    th.start()
    th.join()
    del a
    gc.collect()
    events = [(e, p) for e, p, _ in calls if p in (pa, pb)]
    assert sorted(events) == sorted(
        [("register", pa), ("register", pb), ("unregister", pa), ("unregister", pb)]
    ), f"hook calls: {events}"
    for event, ptr, locked in calls:
        if event == "unregister" and ptr == pa:
            assert locked == locked_with_both, "unregister must run before the pages are unlocked"
    assert area_api.pinned_stats() == s0


_STRESS_PROBE = """
import json, sys, importlib
ranges = importlib.import_module(sys.argv[1])
print(json.dumps(ranges.stress_registry(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
"""


@pytest.mark.requires("concurrent_registry_reads")
def test_registry_native_readers_and_writers_overlap(impl):
    """Registries that claim concurrent reads (``concurrent_registry_reads``) and offer a native stress run
    (``stress_registry`` in their ranges module) survive readers and writers truly overlapping, without the
    GIL.

    Run in a subprocess: a reclamation bug shows up as a crash, which must fail this test, not end the
    session.
    """
    if not impl.provides("ranges") or not hasattr(impl.load("ranges"), "stress_registry"):
        pytest.skip(f"{impl.name} offers no native registry stress run in this build (its ranges module has no "
                    "stress_registry)")
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _STRESS_PROBE, impl.areas["ranges"], "4", "4", "20000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stress run died with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["violations"] == 0, f"registry answered impossibly under contention: {result}"
    assert result["reads"] > 0 and result["writes"] > 0, result

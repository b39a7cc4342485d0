"""The chaos accelerator: deferred, reorderable streams on the host, with a deterministic race detector.

On the ``cpu`` accelerator every copy is synchronous, so an offload engine that forgets an event wait, rewrites a
pool block a copy still reads, or hands out a buffer before its copy landed passes every CPU test. This
accelerator implements the same contract (:class:`reference.contract.accelerators.Accelerator`) with host memory as the
device memory, but a copy issued on a side stream does not run when it is issued: it is queued on that stream and
runs later, at a synchronise, at an event wait, or when the seeded scheduler decides. Streams advance
independently (the scheduler picks which one moves), an event is complete only when the work queued before its
record really ran, and the default stream is the host itself (its work runs in program order).

Two checks make a wrong ordering fail deterministically, whatever the schedule:

- **happens-before**: every stream keeps a vector clock; recording an event snapshots the recording stream's
  clock and waiting on it joins that snapshot into the waiting stream (the host joins at ``synchronize`` and
  at a successful ``query``). Each queued copy registers its source (read) and destination (write) byte
  ranges; each host operation (seen by a ``TorchDispatchMode``, so autograd's backward ops are seen too)
  registers what it writes. An access that conflicts with another stream's access (write/read, read/write,
  write/write) without being ordered after it raises :class:`ChaosViolation` at once, naming both.
- **poison and snapshot**: a queued copy's destination is filled with NaN/0xFF bytes at once, so a read that
  slips past the detector reads garbage (and bitwise comparisons fail); the source is snapshotted, and when the
  copy finally runs a changed source is reported as "written while an in-flight copy read it".
- **lifetime** (the device allocator's rule): memory freed while a copy on another stream still uses it may be
  handed to the next allocation at once, unless ``record_stream`` told the allocator about that stream. The
  queued copies hold only aliases of their tensors, never the caller's tensors, and each storage remembers the
  stream that was current when it was allocated. When a copy runs, a source or destination that nobody but the
  copy still holds, allocated on another stream, and never ``record_stream``-ed on the copy's stream, fails
  with "freed before the copy ran": on a GPU that is a use-after-free (the copy reads or writes bytes the
  allocator already gave away), and here it would otherwise pass because the queue kept the tensor alive.

The accelerator is deliberately **not** registered as an entry point: it must never be picked as a default. The
suite builds one per test (``chaos`` fixture) from a :class:`ChaosSchedule` that hypothesis draws, so a failure
shrinks to a small seed and replays. :meth:`ChaosAccelerator.activate` installs the dispatch mode and the
``record_stream`` shim for the duration of a test body.
"""

from __future__ import annotations

import contextlib
import random
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from reference.contract.accelerators.cpu import CpuAccelerator

__all__ = ["ChaosAccelerator", "ChaosEvent", "ChaosSchedule", "ChaosStream", "ChaosViolation", "Restore"]

HOST = "host"


class ChaosViolation(AssertionError):
    """An access the stream/event ordering does not make safe (a race), found by the chaos accelerator."""


@dataclass(frozen=True)
class ChaosSchedule:
    """How the scheduler behaves: ``seed`` drives every choice; ``eagerness`` is the chance that a scheduling
    point (a queued copy, an event query, a host operation) runs some queued work; ``stall`` names a stream index
    the scheduler never advances on its own (work there runs only when something waits for it)."""

    seed: int
    eagerness: float = 0.3
    stall: int | None = None


def _extent(t: torch.Tensor | None) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` a strided tensor can touch, or None for empty/non-strided tensors (or none)."""
    if t is None:
        return None
    if t.layout != torch.strided or t.numel() == 0 or t.device.type != "cpu":
        return None
    lo = t.data_ptr()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if st > 0)
    return lo, lo + span * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class ChaosStream:
    """A side stream: a FIFO of work items that the scheduler (or a waiter) runs later."""

    def __init__(self, acc: ChaosAccelerator, index: int, name: str) -> None:
        self._acc = weakref.ref(acc)
        self.index = index
        self.name = name
        self.queue: deque[_Work] = deque()
        self.clock: dict[str, int] = {name: 0}

    def __repr__(self) -> str:
        return f"<ChaosStream {self.name} queued={len(self.queue)}>"


class ChaosEvent:
    """``record``/``wait``/``synchronize``/``query`` with real completion; ``elapsed_time`` for timing users."""

    def __init__(self, acc: ChaosAccelerator) -> None:
        self._acc = acc
        self.token: _Work | None = None  # the record item; complete when it ran
        self.clock: dict[str, int] = {}

    def record(self, stream: Any = None) -> None:
        self._acc._record(self, stream)

    def wait(self, stream: Any = None) -> None:
        self._acc._wait(self, stream)

    def synchronize(self) -> None:
        self._acc._host_wait(self)

    def query(self) -> bool:
        return self._acc._query(self)

    def elapsed_time(self, other: ChaosEvent) -> float:
        return 0.0


@dataclass
class _Work:
    kind: str  # "copy" | "record" | "wait"
    stream: ChaosStream
    clock: int = 0
    dst: torch.Tensor | None = None
    src: torch.Tensor | None = None
    snapshot: torch.Tensor | None = None
    event: ChaosEvent | None = None
    awaited: _Work | None = None
    done: bool = False


@dataclass
class _Access:
    stream: str
    clock: int
    rng: tuple[int, int]
    write: bool
    what: str


@dataclass
class Restore:
    """A host-to-device copy out of a block that earlier received a device-to-host copy: a restore (on demand or
    prefetched). ``origin`` is the byte range the offloaded tensor had on the device; ``buffer`` a weak reference
    to the restore destination's storage (dead once nobody holds the restored tensor)."""

    origin: tuple[int, int]
    nbytes: int
    buffer: weakref.ref
    stream: str

    @property
    def alive(self) -> bool:
        return self.buffer() is not None


_POISON_FLOAT = float("nan")
_VIEW_OPS_CACHE: dict[Any, bool] = {}


def _is_view_or_meta(func: Any) -> bool:
    known = _VIEW_OPS_CACHE.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        rets = schema.returns if schema is not None else ()
        known = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
        _VIEW_OPS_CACHE[func] = known
    return known


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments the op writes in place (alias annotations with ``!``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


class _Mode(TorchDispatchMode):
    def __init__(self, acc: ChaosAccelerator) -> None:
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return self.acc._dispatch(func, args, kwargs)


class ChaosAccelerator(CpuAccelerator):
    """See the module docstring. One instance per test; :meth:`activate` around the code under test.

    Its device is the host, as the cpu accelerator's (whose identity, pinning and registration answers it keeps);
    streams, events, synchronisation and memory stats are its own."""

    name = "chaos"
    #: A test device: even if a plugin registered it, it must never become a program's default accelerator.
    may_be_default = False

    def __init__(self, schedule: ChaosSchedule | None = None) -> None:
        self.schedule = schedule or ChaosSchedule(seed=0)
        self._rng = random.Random(self.schedule.seed)
        self._host = ChaosStream(self, -1, HOST)
        self._streams: list[ChaosStream] = []
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._accesses: list[_Access] = []
        self._host_writes: dict[tuple[int, int], _Access] = {}
        # Where offloaded data went: host destination range -> device origin range (the D2H source).
        self._d2h_targets: list[tuple[tuple[int, int], tuple[int, int]]] = []
        self.restores: list[Restore] = []
        self._host_blocks: dict[int, tuple[weakref.ref, int]] = {}
        #: (bytes of the storage written, bytes copied) for every offload copy
        self.offload_blocks: list[tuple[int, int]] = []
        self.record_stream_calls: list[tuple[tuple[int, int] | None, str]] = []
        # storage data pointer -> the stream current when an op watched by the dispatch mode allocated it
        self._alloc_stream: dict[int, str] = {}
        # (storage data pointer, stream name) for every record_stream with a chaos stream
        self._stream_uses: set[tuple[int, str]] = set()
        self.copies_deferred = 0
        self.copies_run_by_scheduler = 0
        self._inside = False

    # -- streams ---------------------------------------------------------------------------------------------
    @property
    def supports_streams(self) -> bool:
        return True

    def current_stream(self) -> ChaosStream:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else self._host

    def new_stream(self) -> ChaosStream:
        with self._lock:
            s = ChaosStream(self, len(self._streams), f"side{len(self._streams)}")
            self._streams.append(s)
            return s

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        if stream is None:
            yield stream
            return
        if not isinstance(stream, ChaosStream):
            raise TypeError(f"stream={stream!r} is not a stream of this chaos accelerator")
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def new_event(self) -> ChaosEvent:  # type: ignore[override]  # the Accelerator contract's event, duck-typed
        return ChaosEvent(self)

    def new_timing_event(self) -> ChaosEvent:
        return ChaosEvent(self)

    def synchronize(self, index: int | None = None) -> None:
        with self._lock:
            self._drain_all()
            for s in self._streams:
                self._join(self._host, s.clock)
            self._prune()

    # -- host memory (nothing to register: this device's memory is the host's) ------------------------------
    def memory_stats(self) -> dict[str, int]:
        return {
            "copies_deferred": self.copies_deferred,
            "copies_run_by_scheduler": self.copies_run_by_scheduler,
            "queued": sum(len(s.queue) for s in self._streams),
        }

    # -- activation -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self) -> Iterator[ChaosAccelerator]:
        """Watch every tensor operation (dispatch mode) and accept ``record_stream`` with chaos streams; on exit
        run every queued copy (so no work outlives the test) and check nothing was left racing."""
        original = torch.Tensor.record_stream
        acc = self

        def record_stream(t: torch.Tensor, stream: Any) -> None:
            if isinstance(stream, ChaosStream):
                acc.record_stream_calls.append((_extent(t), stream.name))
                acc._stream_uses.add((t.untyped_storage().data_ptr(), stream.name))
                return None
            return original(t, stream)

        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]  # patched while active
        mode = _Mode(self)
        try:
            with mode:
                yield self
        finally:
            torch.Tensor.record_stream = original  # type: ignore[method-assign]
            with self._lock:
                self._drain_all()

    # -- the scheduler ----------------------------------------------------------------------------------------
    def _tick(self) -> None:
        """A scheduling point: maybe run some queued work on randomly chosen streams."""
        if self._rng.random() >= self.schedule.eagerness:
            return
        for _ in range(self._rng.randint(1, 4)):
            ready = [
                s for s in self._streams
                if s.queue and s.index != self.schedule.stall and self._runnable(s.queue[0])
            ]
            if not ready:
                return
            s = self._rng.choice(ready)
            if s.queue[0].kind == "copy":
                self.copies_run_by_scheduler += 1
            self._run_head(s)

    def _runnable(self, w: _Work) -> bool:
        return w.kind != "wait" or w.awaited is None or w.awaited.done

    def _run_head(self, s: ChaosStream) -> None:
        with torch.utils._python_dispatch._disable_current_modes():
            self._run_head_unwatched(s)

    def _run_head_unwatched(self, s: ChaosStream) -> None:
        w = s.queue.popleft()
        if w.kind == "copy":
            assert w.dst is not None and w.src is not None and w.snapshot is not None
            self._check_still_owned(s, w, w.src, "source")
            self._check_still_owned(s, w, w.dst, "destination")
            if not torch.equal(w.src, w.snapshot) and not (w.src.is_floating_point() and _same_bits(w.src, w.snapshot)):
                raise ChaosViolation(
                    f"the source of a copy queued on {s.name} (bytes {_extent(w.src)}) was written before the copy "
                    "ran: a source was rewritten while an in-flight copy still read it"
                )
            w.dst.copy_(w.src)
            w.src = w.snapshot = None
            self._resnapshot_readers_of(w.dst)
        w.done = True

    def _check_still_owned(self, s: ChaosStream, w: _Work, alias: torch.Tensor, role: str) -> None:
        """The lifetime rule (module docstring) for one tensor of copy ``w``, about to run on ``s``. Freeing is
        safe when the memory was allocated on ``s`` (the allocator reuses it in ``s``'s order), was
        ``record_stream``-ed on ``s``, or when its allocation stream already waits for this copy (an event
        recorded after it: reuse there is ordered after the copy)."""
        storage = alias.untyped_storage()
        # Two references are this check's: the queued alias and the storage object just taken from it.
        if torch._C._storage_Use_Count(storage._cdata) > 2:  # someone besides this queued copy holds it
            return
        ptr = storage.data_ptr()
        allocated_on = self._alloc_stream.get(ptr, HOST)
        if allocated_on == s.name or (ptr, s.name) in self._stream_uses:
            return
        owner = next((q for q in (self._host, *self._streams) if q.name == allocated_on), None)
        if owner is not None and owner.clock.get(s.name, 0) >= w.clock:
            return
        raise ChaosViolation(
            f"the {role} of a copy queued on {s.name} (bytes {_extent(alias)}, allocated on {allocated_on}) was "
            f"freed before the copy ran, with no record_stream on {s.name}: on a device the allocator may give "
            "those bytes to the next allocation while the copy still uses them (call record_stream with the "
            "copy's stream, or keep the tensor alive until the copy's event completed)"
        )

    def _resnapshot_readers_of(self, written: torch.Tensor) -> None:
        """A copy just wrote ``written``: queued copies reading those bytes take their source snapshot again.

        Such a reader is ordered after this copy (an unordered pair raised in the happens-before check when the later
        of the two was queued, and a reader ordered before it would have run first), so its source changed
        legitimately: an H2D prefetch queued behind the D2H copy that fills its host block, with that copy's event
        as the only order. Only writes after this point, which the happens-before check orders too, may fail the
        snapshot comparison."""
        wrng = _extent(written)
        if wrng is None:
            return
        for q in self._streams:
            for other in q.queue:
                if other.kind != "copy" or other.src is None:
                    continue
                rng = _extent(other.src)
                if rng is not None and _overlaps(wrng, rng):
                    other.snapshot = other.src.clone()

    def _run_until(self, token: _Work) -> None:
        """Run queued work (waits first satisfied in stream order) until ``token`` ran."""
        guard = 0
        while not token.done:
            progressed = False
            for s in [token.stream, *self._streams]:
                while s.queue and self._runnable(s.queue[0]):
                    self._run_head(s)
                    progressed = True
                    if token.done:
                        return
            guard += 1
            if not progressed or guard > 10_000:
                raise ChaosViolation(f"deadlock: {token.stream.name} waits on an event that can never complete")

    def _drain_all(self) -> None:
        for s in self._streams:
            if s.queue:
                self._run_until(s.queue[-1])

    # -- happens-before --------------------------------------------------------------------------------------
    @staticmethod
    def _join(s: ChaosStream, clock: dict[str, int]) -> None:
        for k, v in clock.items():
            if s.clock.get(k, 0) < v:
                s.clock[k] = v

    def _tick_clock(self, s: ChaosStream) -> int:
        s.clock[s.name] = s.clock.get(s.name, 0) + 1
        return s.clock[s.name]

    def _ordered(self, s: ChaosStream, a: _Access) -> bool:
        return a.stream == s.name or s.clock.get(a.stream, 0) >= a.clock

    def _check(self, s: ChaosStream, rng: tuple[int, int], write: bool, what: str) -> None:
        for a in self._accesses:
            if (write or a.write) and _overlaps(a.rng, rng) and not self._ordered(s, a):
                raise ChaosViolation(
                    f"{what} on {s.name} {'writes' if write else 'reads'} bytes {rng} that a "
                    f"{'write' if a.write else 'read'} on {a.stream} ({a.what}) still uses: no event orders them"
                )
        if s is not self._host:
            for a in self._host_writes.values():
                if _overlaps(a.rng, rng) and not self._ordered(s, a):
                    raise ChaosViolation(
                        f"{what} on {s.name} {'writes' if write else 'reads'} bytes {rng} that the host stream "
                        f"wrote ({a.what}) with no event ordering that write before it (missing wait on the "
                        "producer stream)"
                    )

    def _prune(self) -> None:
        everyone = [self._host, *self._streams]
        self._accesses = [a for a in self._accesses if not all(self._ordered(s, a) for s in everyone)]
        if self._streams:
            self._host_writes = {
                k: a for k, a in self._host_writes.items() if not all(self._ordered(s, a) for s in self._streams)
            }
        else:
            self._host_writes.clear()

    # -- events -----------------------------------------------------------------------------------------------
    def _stream_of(self, stream: Any) -> ChaosStream:
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, ChaosStream):
            raise TypeError(f"stream={stream!r} is not a stream of this chaos accelerator")
        return stream

    def _record(self, event: ChaosEvent, stream: Any) -> None:
        with self._lock:
            s = self._stream_of(stream)
            event.clock = dict(s.clock)
            if s is self._host:
                event.token = _Work("record", s, done=True)
                return
            w = _Work("record", s, clock=s.clock.get(s.name, 0), event=event)
            s.queue.append(w)
            event.token = w
            self._tick()

    def _wait(self, event: ChaosEvent, stream: Any) -> None:
        with self._lock:
            s = self._stream_of(stream)
            if event.token is None:
                return
            if s is self._host:
                self._run_until(event.token)
            else:
                s.queue.append(_Work("wait", s, awaited=event.token))
            self._join(s, event.clock)

    def _host_wait(self, event: ChaosEvent) -> None:
        with self._lock:
            if event.token is None:
                return
            self._run_until(event.token)
            self._join(self._host, event.clock)
            self._prune()

    def _query(self, event: ChaosEvent) -> bool:
        with self._lock:
            if event.token is None:
                return True
            self._tick()
            if event.token.done:
                self._join(self._host, event.clock)
                return True
            return False

    # -- tensor operations ---------------------------------------------------------------------------------
    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            s = self.current_stream()
            if func is torch.ops.aten.copy_.default and s is not self._host:
                return self._enqueue_copy(s, args[0], args[1])
            if _is_view_or_meta(func):
                return func(*args, **kwargs)
            flat, _ = tree_flatten((args, kwargs))
            written = _written_args(func, args, kwargs)
            written_ids = {id(t) for t in written}
            name = str(func)
            for t in flat:
                if isinstance(t, torch.Tensor) and id(t) not in written_ids:
                    rng = _extent(t)
                    if rng is not None:
                        self._check(self._host, rng, False, f"host op {name}")
            for t in written:
                rng = _extent(t)
                if rng is not None:
                    self._check(self._host, rng, True, f"host op {name}")
            if func is torch.ops.aten.copy_.default:
                self._note_restore(args[0], args[1], HOST)
            out = func(*args, **kwargs)
            clock = self._tick_clock(self._host)
            outs, _ = tree_flatten(out)
            for t in [*written, *(o for o in outs if isinstance(o, torch.Tensor))]:
                rng = _extent(t)
                if rng is not None:
                    self._host_writes[rng] = _Access(HOST, clock, rng, True, name)
            for o in outs:
                if isinstance(o, torch.Tensor) and id(o) not in written_ids and o.device.type == "cpu":
                    self._alloc_stream[o.untyped_storage().data_ptr()] = s.name  # a new allocation, on s
            self._tick()
            return out

    def _enqueue_copy(self, s: ChaosStream, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if dst.device.type != "cpu" or src.device.type != "cpu":
            raise TypeError("the chaos accelerator's memory is host memory; copies must be between CPU tensors")
        drng, srng = _extent(dst), _extent(src)
        if drng is None or srng is None:
            return dst
        clock = self._tick_clock(s)
        self._check(s, srng, False, "copy source")
        self._check(s, drng, True, "copy destination")
        self._note_restore(dst, src, s.name)
        # Poison now only if no queued copy still uses these bytes (an ordered earlier reader must see the old
        # contents: the write happens when the copy runs, not when it is queued).
        pending = any(
            _overlaps(drng, r)
            for q in self._streams for w in q.queue if w.kind == "copy"
            for r in (_extent(w.src), _extent(w.dst)) if r is not None
        )
        with torch.utils._python_dispatch._disable_current_modes():
            snapshot = src.clone()
            # The queue holds aliases, never the caller's tensors: whether the caller still holds the memory is
            # then visible (the lifetime rule, checked when the copy runs).
            dst_alias, src_alias = dst.detach(), src.detach()
            if pending:
                pass
            elif dst.is_floating_point() or dst.is_complex():
                dst.fill_(_POISON_FLOAT)
            else:
                dst.view(torch.uint8).fill_(0xFF) if dst.is_contiguous() else dst.fill_(-1 if dst.is_signed() else 0)
        self._accesses.append(_Access(s.name, clock, srng, False, f"copy on {s.name}"))
        self._accesses.append(_Access(s.name, clock, drng, True, f"copy on {s.name}"))
        s.queue.append(_Work("copy", s, clock=clock, dst=dst_alias, src=src_alias, snapshot=snapshot))
        self.copies_deferred += 1
        self._tick()
        return dst

    def _note_restore(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        drng, srng = _extent(dst), _extent(src)
        if drng is None or srng is None:
            return
        for target, origin in reversed(self._d2h_targets):
            if target[0] <= srng[0] and srng[1] <= target[1]:
                self.restores.append(
                    Restore(origin, srng[1] - srng[0], weakref.ref(dst.untyped_storage()), stream)
                )
                return
        if stream != HOST:  # a side-stream copy that is no restore: an offload (device -> host block)
            self._d2h_targets = [(t, o) for t, o in self._d2h_targets if not _overlaps(t, drng)]
            self._d2h_targets.append((drng, srng))
            storage = dst.untyped_storage()
            self._host_blocks[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
            self.offload_blocks.append((storage.nbytes(), drng[1] - drng[0]))

    def live_host_block_bytes(self) -> int:
        """Bytes of the distinct, still-alive host storages that offload (D2H) copies wrote into."""
        self._host_blocks = {k: v for k, v in self._host_blocks.items() if v[0]() is not None}
        return sum(n for _, n in self._host_blocks.values())

    def live_restores(self) -> list[Restore]:
        """Restores whose destination buffer is still alive."""
        return [r for r in self.restores if r.alive]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN-aware equality for the source snapshot check (NaN != NaN, but unchanged bits are unchanged)."""
    if a.dtype.itemsize not in (1, 2, 4, 8):
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))

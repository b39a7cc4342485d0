"""Copy timing for the offload stats, measured on the device without host synchronisation.

The engine issues copies asynchronously, so it cannot time them with a host clock: the host would have to wait for
each copy, which is exactly what the streams avoid. Instead a copy is bracketed by two *timing events* recorded on
the stream that runs it (``Accelerator.new_timing_event``; on CUDA ``torch.cuda.Event(enable_timing=True)``), and
the pair is kept until the end event has completed; then ``start.elapsed_time(end)`` is folded into the stats.
Pending pairs are resolved without blocking whenever the backlog grows, and with blocking when the user reads the
stats (so ``manager.stats`` always describes every copy issued so far).

Rules that keep this correct on every accelerator:

- both events of a pair are recorded on the same stream, start after every wait that precedes the copy (so the
  measured span is the copy itself, not the time spent waiting for its producer), end right after the copy;
- the end event is also an ordinary completion event: the engine orders later work after it, so the engine needs
  no second event per copy;
- an accelerator without timing events (``new_timing_event`` returns None) still gets completion events from
  ``new_event``; its copies are simply not timed (the stats then report no rate rather than a wrong one);
- the list of pending pairs has its own lock, held while pairs are folded in: copies are timed from the forward
  thread and from autograd's device threads, and a stats read may resolve them from yet another thread. The lock
  never waits for the engine's lock, so the two cannot deadlock.
"""

from __future__ import annotations

import threading
from typing import Any

from reference.contract.accelerators import Accelerator
from reference.contract.offload_stats import StatsRecorder

#: Kinds of timed spans, and the counters each one feeds.
D2H = "d2h"  # an offload copy on the D2H stream
H2D_PREFETCH = "h2d"  # a prefetch copy on the H2D stream
H2D_ON_DEMAND = "h2d_on_demand"  # a restore copied on the consumer's stream: the consumer waited for all of it
CONSUMER_WAIT = "wait"  # the consumer's stream waiting for a prefetch to land

# Resolve finished pairs once this many are pending, so the list stays short between stats reads.
_BACKLOG = 256


class CopyTimer:
    """Pairs of timing events around copies, folded into a :class:`StatsRecorder` once complete."""

    def __init__(self, accelerator: Accelerator, stats: StatsRecorder, enabled: bool) -> None:
        self._accelerator = accelerator
        self._stats = stats
        self._enabled = enabled
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Any, Any, int]] = []

    def start(self, stream: Any) -> Any | None:
        """Record the start of a timed span on ``stream`` (None when timing is off or the device cannot time)."""
        if not self._enabled:
            return None
        event = self._accelerator.new_timing_event()
        if event is not None:
            event.record(stream)
        return event

    def end(self, kind: str, start: Any | None, stream: Any, nbytes: int) -> Any:
        """Record the end of the span begun by ``start`` on ``stream``; returns an event that completes when the work
        queued on ``stream`` so far has run (a timing event if ``start`` was one, else a plain one)."""
        if start is None:
            event = self._accelerator.new_event()
            event.record(stream)
            return event
        timed = self._accelerator.new_timing_event()
        assert timed is not None  # start is one: the accelerator times its work
        timed.record(stream)
        with self._lock:
            self._pending.append((kind, start, timed, nbytes))
            if len(self._pending) > _BACKLOG:
                self._resolve_locked(block=False)
        return timed

    def resolve(self, block: bool) -> None:
        """Fold finished pairs into the stats; with ``block``, wait for every pending one first."""
        with self._lock:
            self._resolve_locked(block)

    def _resolve_locked(self, block: bool) -> None:
        # The lock is held throughout, so a blocking resolve (a stats read) never returns while another thread is
        # still folding in pairs it took from the list.
        unfinished = []
        for kind, start, end, nbytes in self._pending:
            if not block and not end.query():
                unfinished.append((kind, start, end, nbytes))
                continue
            end.synchronize()
            # start was recorded before end on the same stream, so it has completed too.
            self._account(kind, start.elapsed_time(end) / 1000.0, nbytes)
        self._pending = unfinished

    def _account(self, kind: str, seconds: float, nbytes: int) -> None:
        if kind == D2H:
            self._stats.add(d2h_seconds=seconds, d2h_timed_bytes=nbytes)
        elif kind == H2D_PREFETCH:
            self._stats.add(h2d_seconds=seconds, h2d_timed_bytes=nbytes)
        elif kind == H2D_ON_DEMAND:
            self._stats.add(h2d_seconds=seconds, h2d_timed_bytes=nbytes, compute_wait_seconds=seconds)
        elif kind == CONSUMER_WAIT:
            self._stats.add(compute_wait_seconds=seconds)
        else:
            raise ValueError(f"unknown copy timing kind {kind!r}")

"""Seconds of device work per phase, measured with CUDA timing events, for the offload timeline.

The benchmark's per-phase timeline (docs/benchmarks.md: GPU compute, D2H, host Adam, H2D, exposed wait) needs the
time copies and kernels take *on the device*, which the training thread cannot see without synchronizing after
each of them (and so changing what it measures). A span is a pair of events recorded on a stream around the work;
they are read only when a benchmark asks (:meth:`DeviceSpans.collect`, which synchronizes once), so training pays
two event records per span and nothing else. Both the streamed host update (its copies, the exposed waits, the
split's device Adam) and the device update (its Adam) keep their spans here, so the timeline's keys mean the same
on every update path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DeviceSpans", "timing_event"]


def timing_event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A CUDA event that can be timed, recorded on ``stream`` when one is given."""
    event = torch.cuda.Event(enable_timing=True)
    if stream is not None:
        event.record(stream)
    return event


class DeviceSpans:
    """Spans of device work per key, summed into seconds by :meth:`collect`. Recording is the caller's choice:
    spans pile up until collected, so a path records them only once a benchmark asked for timings."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def add(self, key: str, begin: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Count the device time between two recorded events under ``key``."""
        self._spans.append((key, begin, end))

    def open(self, key: str, stream: torch.cuda.Stream) -> Callable[[], None]:
        """Start a span on ``stream`` now; the returned function ends it there (on the same stream: the span
        covers what was queued on it in between, or the time it was held back)."""
        begin = timing_event(stream)

        def close() -> None:
            self.add(key, begin, timing_event(stream))

        return close

    def collect(self, into: dict[str, float]) -> dict[str, float]:
        """Add every span's seconds to ``into`` under its key (synchronizing the device once) and forget them;
        returns ``into``. A span whose end ran before its begin (events on two streams) counts as 0."""
        if self._spans:
            torch.cuda.synchronize(self.device)
            for key, begin, end in self._spans:
                into[key] = into.get(key, 0.0) + max(0.0, begin.elapsed_time(end) / 1e3)
            self._spans.clear()
        return into

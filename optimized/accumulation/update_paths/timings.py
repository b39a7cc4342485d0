"""Where the streamed update spends its time, for the benchmark's timeline (``engine.offload_timings()``).

Every stage of the streamed update (:mod:`.gradient_stream`, :mod:`.host_worker`, :mod:`.weight_upload`) and the
split's device side write into one :class:`UpdateTimings`, so the keys mean the same whichever stage measured
them. Host seconds are counted always (two clock reads per bucket); device spans are recorded only once a
benchmark asked (:attr:`UpdateTimings.recording`), because they pile up until read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from optimized.accumulation.device_spans import DeviceSpans

__all__ = ["TIMING_KEYS", "UpdateTimings"]

#: What :meth:`UpdateTimings.take` reports, in seconds: ``cpu_adam_s`` (the worker in the kernel),
#: ``wait_s`` (the training thread blocked on an update), ``d2h_s`` (gradients out), ``grad_up_s`` (running sums
#: back up for the next backward's add), ``h2d_s`` (weights in) -- the copies on their streams, summed per bucket,
#: overlapping other work --, ``grad_exposed_s`` (how long the gradient stream ran on after the boundary's
#: backward: the boundary waits for it), ``device_adam_s`` (R28's device side, on the training stream) and
#: ``gpu_idle_s``: how long the training stream sat idle because of the update -- ``wait_s`` is the *thread's*
#: blocked time, and the thread launches ahead of the GPU, so the GPU may run queued work through much of it. Per
#: wait, an event recorded before the thread blocks (done when the work queued before the wait is) and one after
#: it and after the stream's wait for the bucket's H2D; the gap between them is the stream's idle time.
#: ``host_add_s``: the middle backwards' running sums added on the host (:mod:`.host_sums`), beside the step.
TIMING_KEYS = ("cpu_adam_s", "wait_s", "d2h_s", "grad_up_s", "h2d_s", "grad_exposed_s", "device_adam_s",
               "gpu_idle_s", "host_add_s")


class UpdateTimings:
    """Seconds per :data:`TIMING_KEYS` since the last :meth:`take`, shared by the stages of one streamed update."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = device.type != "cpu"
        self._seconds = dict.fromkeys(TIMING_KEYS, 0.0)
        #: bytes the CPU Adam moved (its one-pass count) in the seconds counted under ``cpu_adam_s``
        self._kernel_bytes = 0
        self._spans = DeviceSpans(device)
        #: whether device spans are recorded (from the first :meth:`take` on)
        self.recording = False

    def add(self, key: str, seconds: float) -> None:
        """Count host seconds under ``key`` (the worker's kernel time, the training thread's waits)."""
        self._seconds[key] += seconds

    def add_kernel_bytes(self, nbytes: int) -> None:
        """Count the bytes one CPU Adam call moved (reported as ``cpu_adam_bytes``: with ``cpu_adam_s``, the host
        update's bandwidth inside the engine, issue 49 item 3)."""
        self._kernel_bytes += nbytes

    def seconds(self, key: str) -> float:
        """Host seconds counted under ``key`` since the last :meth:`take`."""
        return self._seconds[key]

    def span(self, key: str, begin: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Count the device time between two recorded events under ``key`` (only while :attr:`recording`)."""
        if self.recording:
            self._spans.add(key, begin, end)

    def time_device_work(self, key: str) -> Callable[[], None] | None:
        """Start timing, under ``key``, what the current stream runs (or waits) from now until the returned
        function is called (device runs once timings were asked for), else None."""
        if not (self.on_device and self.recording):
            return None
        return self._spans.open(key, torch.cuda.current_stream(self.device))

    def take(self) -> dict[str, float]:
        """Seconds since the last call, per :data:`TIMING_KEYS`, and ``cpu_adam_bytes`` (synchronizes the device
        once to read the spans). The caller turned :attr:`recording` on and waited for the update in flight first."""
        self._spans.collect(self._seconds)
        out, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        out["cpu_adam_bytes"], self._kernel_bytes = float(self._kernel_bytes), 0
        return out

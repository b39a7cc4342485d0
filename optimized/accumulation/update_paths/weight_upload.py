"""The streamed update's last stage: a bucket's new model-dtype weights into the live parameters.

On a device run each bucket is one H2D on a stream of its own, queued after a fence the boundary recorded on the
training stream (the copy must not overtake the kernels already queued that still read the old weights: the end
of backward, stage-3 gathers); its event is what the next forward waits for, per bucket
(:meth:`WeightUpload.queue_wait`). Where the parameters are on the host it is a plain copy. R27's publish (the
previous boundary's weights, before this boundary's Adam overwrites their source) is the same copy; the worker
waits for its read (:meth:`WeightUpload.wait_read`) before the kernel writes the source again.
"""

from __future__ import annotations

import torch

from optimized.accumulation.device_spans import timing_event
from optimized.accumulation.update_paths.timings import UpdateTimings

__all__ = ["WeightUpload"]


class WeightUpload:
    """Per bucket, the copy of its weights into the live parameters and the event the readers wait for."""

    def __init__(self, device: torch.device, buckets: int, timings: UpdateTimings) -> None:
        self.device = device
        self.on_device = device.type != "cpu"
        self._timings = timings
        if self.on_device:
            self._h2d_stream = torch.cuda.Stream(device)
            self._h2d_done: list[torch.cuda.Event | None] = [None] * buckets
        #: R27: per bucket, the event of its publish H2D the worker waits for before overwriting the source
        self._publish_read: list[torch.cuda.Event | None] = [None] * buckets
        self._fence: torch.cuda.Event | None = None

    def fence(self) -> None:
        """On the training thread, before the worker starts: the H2D copies from now on wait for the work queued
        on the current stream so far (device runs)."""
        if self.on_device:
            self._fence = torch.cuda.Event()
            self._fence.record(torch.cuda.current_stream(self.device))

    def copy(self, index: int, src: torch.Tensor, dst: torch.Tensor, *, publish: bool) -> None:
        """Bucket ``index``'s weights ``src`` into the live parameters ``dst``: H2D on the upload stream after the
        fence (its event is what the next forward waits for), or a host copy. ``publish``: R27's copy, whose read
        of ``src`` :meth:`wait_read` waits for."""
        if self.on_device and dst.device.type != "cpu":
            with torch.cuda.device(self.device), torch.cuda.stream(self._h2d_stream):
                assert self._fence is not None  # fence() runs before the worker's first copy
                self._h2d_stream.wait_event(self._fence)
                begin = timing_event(self._h2d_stream)
                dst.copy_(src, non_blocking=True)
                event = timing_event(self._h2d_stream)
            self._timings.span("h2d_s", begin, event)
            if publish:
                self._publish_read[index] = event
            self._h2d_done[index] = event
        else:
            dst.copy_(src)

    def wait_read(self, index: int) -> None:
        """R27, on the worker: bucket ``index``'s publish has read its source (which the Adam writes next)."""
        read = self._publish_read[index]
        if read is not None:
            read.synchronize()
            self._publish_read[index] = None

    def pending(self, index: int) -> bool:
        """Whether bucket ``index`` has a device copy the current stream has not been made to wait for."""
        return self.on_device and self._h2d_done[index] is not None

    def queue_wait(self, index: int) -> None:
        """Work queued on the current stream from now on waits for bucket ``index``'s copy (see :meth:`pending`)."""
        done = self._h2d_done[index]
        assert done is not None  # called where pending(index) said so
        torch.cuda.current_stream(self.device).wait_event(done)
        self._h2d_done[index] = None

    def close(self) -> None:
        """Let the copies in flight finish (errors dropped: called from destroy)."""
        if self.on_device:
            try:
                self._h2d_stream.synchronize()
            except BaseException:
                pass

"""Where a ZeroEngine's gradients go during backward (R7, R9, R10).

- Stages 0/1: each backward adds every parameter's gradient into the update path's flat accumulation buffer
  straight from a post-accumulate-grad hook (``p.grad`` is dropped at once, so no second full-size gradient copy
  lives on). The boundary reduces it once.
- Stages 2/3: the hook copies the gradient into the bucket's communication buffer (the update path says where);
  when the last gradient of a bucket has arrived the bucket's rank-ordered reduce-scatter is launched
  asynchronously (gloo's worker threads, or NCCL's stream), so it overlaps the rest of backward; at the end of
  backward the buckets whose parameters got no gradient are launched with zeros (R7) and the update path adds
  this rank's reduced slices into its partition accumulator (R10).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from optimized.accumulation.buckets import Bucket
from optimized.accumulation.collectives import Collectives
from optimized.accumulation.partition import FlatLayout
from optimized.accumulation.update_paths import UpdatePath

__all__ = ["GradientHooks"]


class GradientHooks:
    """The post-accumulate-grad hooks of one engine and the bucket reductions they launch."""

    def __init__(
        self,
        *,
        stage: int,
        layout: FlatLayout,
        comm: Collectives,
        accum_dtype: torch.dtype,
        buckets: list[Bucket],
        in_backward: Callable[[], bool],
    ) -> None:
        self.stage, self.layout, self._comm, self._accum_dtype = stage, layout, comm, accum_dtype
        self.buckets = buckets
        self._segments = {s.name: s for s in layout.segments}
        self._bucket_of = {n: b for b in buckets for n in b.names}
        self._got_grad: set[str] = set()
        self._in_backward = in_backward
        self._path: UpdatePath | None = None

    @property
    def _attached(self) -> UpdatePath:
        """The update path :meth:`attach` connected (the hooks it installs are the only callers before it)."""
        assert self._path is not None, "GradientHooks used before attach()"
        return self._path

    def attach(self, path: UpdatePath, params: dict[str, nn.Parameter], add_hook: Callable[[Any], None]) -> None:
        """Hook every trainable parameter; gradients go to ``path``."""
        self._path = path
        for name in self._segments:
            add_hook(params[name].register_post_accumulate_grad_hook(self._make_hook(name)))

    def begin(self) -> None:
        """A backward starts: every bucket waits for all its gradients again."""
        self._got_grad.clear()
        for b in self.buckets:
            b.reset()

    def run(self, backward: Callable[[], None]) -> None:
        """One engine backward: ``backward()`` between :meth:`begin` and :meth:`finish` (stages 2/3); a failure
        drops the buckets' state (:meth:`abandon`) and propagates."""
        if self.stage >= 2:
            self.begin()
        try:
            backward()
            if self.stage >= 2:
                self.finish()
        except BaseException:
            self.abandon()
            raise

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        seg = self._segments[name]
        # The hook lives on the parameter, where the garbage collector cannot see it (torch keeps the tensor alive
        # from C++): a strong reference back to this object would make an engine dropped without destroy() --
        # and its pinned buffers -- uncollectable. A weak one lets it go.
        owner = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            self = owner()
            if self is None or not self._in_backward() or p.grad is None:
                return  # a backward not driven by engine.backward(): leave p.grad to the caller
            g = p.grad.reshape(-1)
            if self.stage <= 1:
                # R9: acc = acc + g.to(accum_dtype), per backward, locally.
                self._attached.accumulator[seg.offset : seg.end].add_(g.to(self._accum_dtype))
            else:
                # R10: this backward's gradient in the communication dtype, reduced per bucket.
                bucket = self._bucket_of[name]
                self._attached.bucket_gradients(bucket)[seg.offset - bucket.start : seg.end - bucket.start].copy_(g)
                self._got_grad.add(name)
                if bucket.gradient_arrived():
                    self._launch(bucket)
            p.grad = None

        return hook

    def _launch(self, bucket: Bucket) -> None:
        grads = self._attached.bucket_gradients(bucket)
        # R10's divided term; x / 1 is x exactly, so one rank sends the bucket itself (no bucket-sized copy live
        # while the reduction runs: 0.12 GiB for the vocabulary buckets of the 886M shape, issue 49 item 2)
        contribution = grads if self._comm.world == 1 else torch.div(grads, self._comm.world)
        bucket.launched(contribution,
                        self._comm.start_reduce_scatter(contribution, bucket.splits, "bucket reduce-scatter"))
        self._attached.bucket_launched(bucket)

    def finish(self) -> None:
        """End of a stage-2/3 backward: launch the buckets whose parameters got no gradient (R7: zeros), then the
        update path absorbs every bucket (R10)."""
        for b in self.buckets:
            if b.pending:  # not launched by the hooks: some parameter got no gradient
                for n in b.names:
                    if n not in self._got_grad:
                        s = self._segments[n]
                        self._attached.bucket_gradients(b)[s.offset - b.start : s.end - b.start].zero_()
                self._launch(b)
        self._attached.finish_backward(self.buckets)

    def abandon(self) -> None:
        """A backward failed: drop the buckets' state (the failing rank does not wait on its peers)."""
        for b in self.buckets:
            b.grads = None
            b.reduce = None
            b.keep_alive = None

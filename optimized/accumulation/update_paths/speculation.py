"""R30 (``host_update_start: last_backward``): the host update of a boundary started under its last backward,
speculatively unclipped, and redone from the untouched state where the global norm then clips.

R15 needs the global norm before any update, and the norm needs every bucket's gradient; so the streamed update
(:mod:`.host_worker`) starts in ``step()``. But the last layers' gradients are final early in the boundary's last
backward, and most boundaries of a warmed-up run do not clip. This stage runs each bucket's CPU Adam on the
worker thread as soon as the bucket's gradient has landed on the host (:meth:`.GradientStream.wait_landed`: the
D2H event of that bucket, recorded before the bucket is handed here), in the order the buckets complete (last
layers first), with:

- the hyper-parameters a step would use now (the engine's ``hyper_now()``) and the next step count, and
- no clipping (``clip_coef`` None: :func:`reference.contract.accumulation_norm.clip_coefficient` returns None
  exactly when the coefficient is not below 1, and the kernel then reads the gradient unscaled -- the arithmetic
  of ``step()`` for such a boundary, bit for bit).

Before a bucket's speculative update, its fp32 master and moments are copied into a backup buffer (the kernel
updates in place; it writes the backup itself, block by block in its one pass, so the state is read once). In
``step()``, on the worker, in flat order (:meth:`SpeculativeUpdate.settle`): a bucket whose speculation used this
boundary's hyper-parameters, step and an unclipped gradient stands as it is; any other (the norm clips, or the
learning rate changed between the backward and the step) is restored from the backup and updated again with the
step's values -- the arithmetic of R15/R16 on the same inputs, so a boundary that clips is bitwise the one of
``host_update_start: step``. Nothing speculative reaches the live parameters: the kernel writes the model-dtype
weights into a cast buffer of its own, uploaded only once the bucket is settled (:class:`.WeightUpload`, flat
order).

Speculation ends when ``step()`` has the norm (:meth:`SpeculativeUpdate.claim`): the speculative updates not
begun yet are skipped, and the step's task updates those buckets once, as without R30, in flat order -- the order
the next forward needs them (the speculation runs in the order gradients land, last layers first, and backs each
bucket up). So what runs under the last backward is a head start on the last layers, and a boundary that clips
redoes only the buckets speculated by then. And a boundary that follows one whose norm clipped is not speculated at
all (counted in ``boundaries_not_speculated``): the norms of consecutive boundaries are close, so early in
training, where every boundary clips, the path is the ``step`` path at its cost, and it speculates again from the
boundary after the first one that does not clip. An engine's first boundary is speculated.

A speculation that no step claims is undone (:meth:`SpeculativeUpdate.discard`: restored from the backup): a
backward after the predicted boundary's (the boundary moved), ``zero_grad()``, a read of the master or the
optimizer state (a checkpoint save between the backward and the step), a checkpoint load.

R28 (the split): only the host side speculates (the worker's ``host_part`` of each bucket); the device side
steps in ``step()`` as without R30. A cut made at a boundary whose buckets were already updated early (a fixed
share's first boundary, "auto"'s second) first gives the device side its elements back as they were before the
step (:meth:`SpeculativeUpdate.release_leading`: the speculations finished, ``[0, cut)`` restored from the backup),
so the device side starts from the state R28 says and the host settles only what stays its own.

Why a backup and not side buffers: the native kernel updates in place. Writing the speculative results beside
the state and committing them on confirmation would put a copy of the state (read and write) on the critical
path of every boundary that does not clip -- the common case; the backup writes the same bytes before the
speculative update, under the backward, in the kernel's pass, and the redo (rare) pays the restore.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from optimized.accumulation.update_paths.norm_sums import BucketRange
from reference.contract.accumulation_config import OptimizerConfig

if TYPE_CHECKING:
    from optimized.accumulation.update_paths.gradient_stream import GradientStream

#: One bucket's R15 + R16 on the worker's kernel: ``(bucket, hyper-parameters, step, clip_coef, gradient, backup)``
#: (``backup``: None, or the bucket's slices of the backup of :data:`BACKED_UP`, which the kernel fills first).
AdamFn = Callable[[BucketRange, OptimizerConfig, int, "float | None", torch.Tensor, "tuple | None"], object]

#: The state one bucket's update writes in place, in the kernel's backup order.
BACKED_UP = ("master", "exp_avg", "exp_avg_sq")

__all__ = ["SpeculativeUpdate"]

#: What :meth:`SpeculativeUpdate.report` counts since construction.
REPORT_KEYS = ("boundaries_speculated", "buckets_speculated", "boundaries_redone", "buckets_redone",
               "speculations_discarded", "boundaries_not_speculated")


class SpeculativeUpdate:
    """The speculative stage of one rank's streamed host update (see the module docstring).

    ``state``: the buffers one bucket's update writes in place (the fp32 master and the moments), by name;
    ``backup``: allocates a host buffer like one of them (the backup, made when the first speculation opens).
    """

    def __init__(self, *, gradients: GradientStream, state: Mapping[str, torch.Tensor],
                 backup: Callable[[torch.Tensor], torch.Tensor], hyper_now: Callable[[], OptimizerConfig]) -> None:
        if sorted(state) != sorted(BACKED_UP):
            # The kernel backs up exactly these, in this order: a state of other names has no backup to redo from.
            raise ValueError(f"SpeculativeUpdate: state names {sorted(state)}; allowed: exactly {list(BACKED_UP)}")
        self._gradients = gradients
        self._state = dict(state)
        self._make_backup = backup
        self._backup: dict[str, torch.Tensor] | None = None
        self._hyper_now = hyper_now
        #: the worker's thread and kernel (:meth:`bind`)
        self._run_on_thread: Callable[[Callable[[], None]], Future] | None = None
        self._adam: AdamFn | None = None
        #: R28: the part of a bucket the host updates (None: all of it is the device side's)
        self._host_part: Callable[[BucketRange], BucketRange | None] = lambda b: b
        #: (hyper-parameters, step) the open speculation used; None: nothing speculated since the last boundary
        self._guess: tuple[OptimizerConfig, int] | None = None
        #: whether a step took the open speculation over (its task settles it; nothing may discard it then)
        self._claimed = False
        self._futures: list[Future] = []
        #: buckets updated speculatively (written by the worker thread; read once its futures are done)
        self._speculated: dict[int, BucketRange] = {}
        self._redone_here = 0
        #: the step claimed the open speculation: the speculative updates not begun yet are skipped (set under
        #: the lock; reset with the speculation) and the step's task updates those buckets in flat order
        self._closed = False
        #: whether the last boundary's norm clipped: the next boundary is then not speculated (norms of
        #: consecutive boundaries are close, so it would most likely be redone: twice the host update)
        self._previous_clipped = False
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REPORT_KEYS, 0)

    def bind(self, run_on_thread: Callable[[Callable[[], None]], Future], adam: AdamFn,
             host_part: Callable[[BucketRange], BucketRange | None]) -> None:
        """The worker's thread (first in, first out with its updates), its kernel and its R28 cut, which the
        speculation uses (called by the worker's constructor; callbacks, so this module does not import the
        worker's)."""
        self._run_on_thread = run_on_thread
        self._adam = adam
        self._host_part = host_part

    # ---- the boundary's last backward ---------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A backward the schedule predicts is the boundary's starts; the boundary will be step ``step``."""
        self.discard()
        if self._previous_clipped or not any(self._host_part(b) for b in self._gradients.ranges if b.length):
            # after a clipped boundary; or R28 left the host no element to update
            self._counts["boundaries_not_speculated"] += 1
            return
        if self._backup is None:  # here, on the training thread, like every other allocation of the engine
            self._backup = {name: self._make_backup(buf) for name, buf in self._state.items()}
        self._guess = (self._hyper_now(), step)
        self._counts["boundaries_speculated"] += 1

    def bucket_landed(self, b: BucketRange) -> None:
        """Bucket ``b``'s gradient is final and its D2H queued (its event recorded): update it on the worker."""
        if self._guess is None or self._claimed or not b.length or self._host_part(b) is None:
            return
        assert self._run_on_thread is not None
        self._futures.append(self._run_on_thread(lambda: self._speculate(b)))

    def _speculate(self, b: BucketRange) -> None:
        """On the worker thread: back the bucket's state up, then R15 + R16 unclipped with the guessed values."""
        self._gradients.wait_landed(b.index)  # the bucket's D2H has run: its host gradient is final
        with self._lock:
            if self._closed:  # the step has the norm: its task updates the bucket, in the forward's order
                return
        # connect() made the hooks and the buffers, and bucket_landed() launched this for a guess
        assert self._guess is not None and self._adam is not None and self._backup is not None
        hyper, step = self._guess
        part = self._host_part(b)  # R28: the cut moves only after this speculation's futures ran (release_leading)
        assert part is not None
        b = part
        # The kernel copies each block of the bucket's state into the backup just before updating it, in its one
        # pass (the block is in cache by then: the backup costs its writes, not a second pass over the state). It
        # validates its arguments before writing anything and then always completes, so the bucket is recorded
        # after it: one that raised left its state untouched and has nothing to restore.
        backup = tuple(self._backup[name][b.lo : b.hi] for name in BACKED_UP)
        self._adam(b, hyper, step, None, self._gradients.accumulator, backup)
        with self._lock:
            self._speculated[b.index] = b
            self._counts["buckets_speculated"] += 1

    def _restore(self, lo: int, hi: int) -> None:
        """The state of ``[lo, hi)`` as the backup holds it (before the speculative update)."""
        assert self._backup is not None  # only a speculation, which had the backup, is restored
        for name, buf in self._state.items():
            buf[lo:hi].copy_(self._backup[name][lo:hi])

    def release_leading(self, n: int) -> None:
        """R28: the device side takes ``[0, n)`` at this boundary. Wait for the speculation's updates, restore
        their ``[0, n)`` from the backup -- the state before the step, which the device side starts from -- and
        keep for the step's settlement only their parts from ``n`` on (the host's). Called by the worker's
        ``update_from`` on the training thread after ``claim``, before the step's task is queued."""
        concurrent.futures.wait(self._futures)  # every one has run (the step closed the rest)
        with self._lock:
            kept = {}
            for index, b in self._speculated.items():
                if b.lo < n:
                    self._restore(b.lo, min(b.hi, n))
                if b.hi > n:
                    kept[index] = b if b.lo >= n else BucketRange(b.index, n, b.hi)
            self._speculated = kept
        for f in self._futures:  # an error of an early update is the step's (as in settle)
            f.result()

    # ---- step(): settle -------------------------------------------------------------------------------------
    def claim(self, config: OptimizerConfig, step: int, clip_coef: float | None) -> None:
        """``step()`` takes the open speculation over (the update task it queues settles it). The speculative
        updates not begun yet are skipped: the step's task updates those buckets once, exactly, in flat order --
        the order the next forward needs them, where the speculation ran in the order the gradients landed (last
        layers first), with a backup each. Whether this boundary clipped (``clip_coef``) decides whether the
        next one speculates."""
        self._previous_clipped = clip_coef is not None
        if self._guess is not None:
            self._claimed = True
            with self._lock:
                self._closed = True

    def settle(self, b: BucketRange, config: OptimizerConfig, step: int, clip_coef: float | None,
               grad: torch.Tensor) -> bool:
        """On the worker thread, in the step's task: True when bucket ``b`` is updated with the step's values --
        its speculation stands, or it was restored and updated again; False: not speculated (update it)."""
        for f in self._futures:  # done already (one thread, first in first out); re-raises a speculation's error
            f.result()
        with self._lock:
            speculated = self._speculated.get(b.index)
        if speculated is None or not self._claimed:
            return False
        if clip_coef is None and self._guess == (config, step):
            return True
        self._restore(speculated.lo, speculated.hi)
        assert self._adam is not None  # connected before anything was speculated
        self._adam(speculated, config, step, clip_coef, grad, None)
        self._redone_here += 1
        return True

    def finish(self) -> None:
        """On the worker thread, after the step's task settled every bucket: count, and close the speculation."""
        if self._claimed:
            if self._redone_here:
                self._counts["boundaries_redone"] += 1
                self._counts["buckets_redone"] += self._redone_here
            self._reset()

    def _reset(self) -> None:
        self._guess = None
        self._claimed = False
        self._futures = []
        self._speculated = {}
        self._redone_here = 0
        with self._lock:
            self._closed = False

    # ---- undo -----------------------------------------------------------------------------------------------
    def discard(self) -> None:
        """Undo a speculation no step claimed (see the module docstring): wait for it, restore every bucket it
        updated from the backup. Errors of the speculative updates are raised here."""
        if self._guess is None or self._claimed:
            return
        futures, self._futures = self._futures, []
        concurrent.futures.wait(futures)  # every one has run (restoring under a running one would race it)
        for b in self._speculated.values():
            self._restore(b.lo, b.hi)
        self._counts["speculations_discarded"] += 1
        self._reset()
        for f in futures:
            f.result()

    def report(self) -> dict[str, int]:
        """Counts since construction, per :data:`REPORT_KEYS` (the update of the last boundary included once its
        step's task finished: the caller waited for it)."""
        return dict(self._counts)

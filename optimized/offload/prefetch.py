"""When the optimized engine issues a planned prefetch: right after the memory peak that follows a restore.

At every restore the engine plans the next ``prefetch_count`` offloaded activations in backward order
(``StreamedOffloadEngine`` decides *which*); this module decides *when* their buffers are allocated and their
copies issued. Where the device reports no allocation counter the engine issues them at once instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

# How many autograd nodes after a restore get a one-shot post-hook that may issue the planned prefetch.
_PREFETCH_HOOK_NODES = 8
# After this many of those hooks ran without a safe moment, the planned prefetch is issued anyway: a late
# prefetch still beats a copy on demand. Six covers one MLP block (the post-peak frees show up at the fifth).
_PREFETCH_DEADLINE_NODES = 6


class PlannedCopy(Protocol):
    """What this module reads of a planned prefetch: its size (the engine's saved activation)."""

    @property
    def nbytes(self) -> int: ...


class DeferredPrefetch:
    """Prefetch planned at a restore, issued right after the region's memory peak has been released.

    Allocating the look-ahead buffers at the moment a tensor is restored would add them on top of the peak of
    the backward ops that follow (the restored tensor's consumers allocate their gradients right after). So
    the buffers are allocated from one-shot post-hooks on the next autograd nodes, at the first node boundary
    where memory has just fallen: ``allocated + buffer`` is at most the previous boundary's sample (at least a
    buffer's worth was freed since: the tensors of a peak) and at most the highest sample since the restore.
    Issued there, the buffer fills room that a peak already used, and its copy overlaps the rest of the
    region's backward (in a transformer MLP block: the first linear layer's two matmuls).

    Two tempting signals are wrong. The allocator's global peak (``max_memory_allocated``) includes the peaks
    of earlier regions of the same shape, so it reports headroom before this region's own peak has happened;
    issuing on it raised the H200 benchmark's peak by most of a buffer. And a node's post-hook runs before
    autograd frees that node's inputs and saved tensors, so the hook of the node that makes the peak still
    sees the peak: the fall shows up one boundary later, which is what the "fallen since the previous sample"
    test waits for. After ``_PREFETCH_DEADLINE_NODES`` hooks without such a moment the prefetch is issued
    anyway (bounded lateness).

    The engine is reached through two callbacks, bound methods of it held weakly (a hook left on a graph must not
    keep a closed engine alive): ``allocated_bytes()``, the device bytes allocated now (None: not reported), and
    ``issue(candidate, epoch)``, which issues a planned copy unless it became pointless. This module then knows
    nothing of the engine, and the engine imports it without a cycle.
    """

    def __init__(
        self, allocated_bytes: Callable[[], int | None], issue: Callable[[Any, int], None],
        candidates: Sequence[PlannedCopy], epoch: int, start: int,
    ) -> None:
        self._allocated_bytes = weakref.WeakMethod(allocated_bytes)
        self._issue = weakref.WeakMethod(issue)
        self._pending = [weakref.ref(c) for c in candidates]
        self._epoch = epoch
        self._high = start
        self._previous = start
        self._calls = 0

    def attach(self, node: Any) -> None:
        queue = [node]
        # Keyed by id() but holding the node objects: the Python wrappers next_functions hands out can be
        # temporary, and a freed wrapper's id is reused by the next one, which would then be skipped as "seen"
        # (on the H200 run that cut the walk off after three nodes, before the block's memory peak).
        seen: dict[int, Any] = {}
        attached = 0
        while queue and attached < _PREFETCH_HOOK_NODES:
            current = queue.pop(0)
            if current is None or id(current) in seen:
                continue
            seen[id(current)] = current
            if type(current).__name__ != "AccumulateGrad":
                current.register_hook(self._on_node_done)
                attached += 1
            queue.extend(fn for fn, _ in current.next_functions)

    def _on_node_done(self, grad_inputs: Any, grad_outputs: Any) -> None:
        allocated_bytes, issue = self._allocated_bytes(), self._issue()
        if allocated_bytes is None or issue is None or not self._pending:
            return
        allocated = allocated_bytes()
        if allocated is None:
            return
        self._calls += 1
        self._high = max(self._high, allocated)
        previous, self._previous = self._previous, allocated
        deadline = self._calls >= _PREFETCH_DEADLINE_NODES
        while self._pending:
            candidate = self._pending[0]()
            if candidate is None:
                self._pending.pop(0)
                continue
            after = allocated + candidate.nbytes
            if not deadline and (after > previous or after > self._high):
                return
            self._pending.pop(0)
            issue(candidate, self._epoch)
            allocated = after


def current_autograd_node() -> Any:
    """The autograd node running now (None outside backward, or on a torch without the accessor)."""
    getter = getattr(torch._C, "_current_autograd_node", None)
    return getter() if getter is not None else None

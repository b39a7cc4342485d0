"""Rank-ordered collectives on torch.distributed (R9, R10, R14, R24).

A transport's all-reduce / reduce-scatter adds the ranks' contributions in an order it chooses (ring position,
tree shape, NCCL channel), so from three ranks on the last bits depend on it (R24). This engine instead moves
the contributions with ``all_to_all`` -- each rank sends every other rank the slice that rank owns, which is
exactly the traffic of a ring reduce-scatter, ``(W-1)/W`` of the buffer per rank -- and the owner adds the W
slices itself, in rank order. The result is the reference's ``sum over r in rank order of (x_r / W)`` at every
world size, on gloo and NCCL alike, which is why the implementation can declare
``accumulation_rank_ordered_reduction`` (R25). An all-reduce is that reduce-scatter plus an all-gather (the
same bytes as a ring all-reduce).

Every call goes through :class:`Collectives`, which turns a transport failure (a timeout because another rank
died or stopped calling, a closed connection) into :class:`CollectiveError` naming the collective, this rank,
and the likely cause, instead of a bare gloo/NCCL message.

Every tensor handed to the transport is also held by :data:`HANDOFF` until the transport's own threads have let
go of it. ``work.wait()`` returns while a gloo worker still holds the work and its tensors (their use count is
still 4 right after the wait); the worker drops them a moment later. If Python has already released such a
tensor, the worker's drop is the last one, frees the Python object and so needs the GIL -- and if that happens
while the interpreter is finalizing, the thread is unwound by ``pthread_exit`` through a ``noexcept`` frame and
the process dies with "terminate called without an active exception" after the script finished. Calling
``dist.destroy_process_group()`` does not help: once ``torch._dynamo`` is imported (creating any
``torch.optim.Optimizer`` does it) torch keeps references to the default group, so its threads outlive the
destroy call. Reproduced with torch alone (2 gloo ranks, 50 async broadcasts of temporaries, destroy, exit:
4 aborts in 30 runs on a 2-core box) and through this class (9 in 40 with the handoff disabled, 0 in 40 with
it). Handing the transport an alias that is held until the transport's count on it has dropped makes the main
thread, which owns the GIL, release the last reference.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reference.contract.accumulation_norm import fold_left
from reference.contract.errors import CollectiveError

__all__ = ["HANDOFF", "CollectiveError", "Collectives", "PendingReduce", "TransportHandoff", "fold_in_rank_order"]


def _all_gather(output: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
    """torch.distributed's all-gather into one tensor, looked up when called: torch >= 2.13 renames
    ``all_gather_into_tensor`` (and warns on the old name); 2.4-2.12 only have the old one."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, part, group=group)


class TransportHandoff:
    """Tensors handed to a collective, held until the transport's threads no longer reference them (see the
    module docstring for the crash this prevents). Process-wide, thread-safe and fork-aware (a child starts
    with nothing held: the parent's transport threads do not exist there)."""

    #: how long :meth:`drain` waits for the transport to let go before giving up (it never hangs an exit)
    DRAIN_TIMEOUT_S = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[torch.Tensor] = []
        self._atexit_registered = False

    def lend(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Aliases of ``tensors`` (same memory, no autograd link) to hand to the transport instead of them, held
        here until only this object references them. An alias nobody else knows has use count 1 once the
        transport has let go, whatever views or autograd nodes reference the original. Also lets go of earlier
        aliases the transport has released."""
        aliases = tuple(t.detach() for t in tensors)
        with self._lock:
            self._prune()
            self._held.extend(aliases)
            if not self._atexit_registered:
                atexit.register(self.drain)
                self._atexit_registered = True
        return aliases

    def held(self) -> int:
        """How many tensors are still held (some transport thread may still reference them)."""
        with self._lock:
            return len(self._held)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait (releasing the GIL) until the transport holds none of the tensors, then drop them here; returns
        whether it let go in time (a transport still running a collective that another rank never joined keeps
        its tensors: then the tensors stay held). Called by ``ZeroEngine.destroy()`` and at interpreter exit."""
        deadline = time.monotonic() + (self.DRAIN_TIMEOUT_S if timeout is None else timeout)
        while True:
            with self._lock:
                self._prune()
                if not self._held:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _prune(self) -> None:
        self._held = [t for t in self._held if t._use_count() > 1]  # type: ignore[attr-defined]  # torch-private

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._held = []


#: the process-wide handoff every :class:`Collectives` holds its tensors in
HANDOFF = TransportHandoff()
os.register_at_fork(after_in_child=HANDOFF._after_fork_in_child)


def fold_in_rank_order(chunks: torch.Tensor, world: int) -> torch.Tensor:
    """``chunks`` is ``[world, n]`` holding each rank's (already divided) contribution, in rank order; returns
    ``chunks[0] + chunks[1] + ...`` added left to right in their dtype (R9/R10's rank-ordered sum)."""
    total = chunks[0].clone() if world == 1 else torch.add(chunks[0], chunks[1])
    for q in range(2, world):
        total = torch.add(total, chunks[q])
    return total


class PendingReduce:
    """An in-flight rank-ordered reduce-scatter of one bucket; :meth:`result` waits and folds."""

    def __init__(self, owner: Collectives, work: Any, recv: torch.Tensor, length: int, what: str) -> None:
        self._owner = owner
        self._work = work
        self._recv = recv
        self._length = length
        self._what = what

    def result(self) -> torch.Tensor:
        """This rank's slice of the bucket, reduced (comm dtype)."""
        if self._work is not None:
            self._owner._wait(self._work, self._what)
            self._work = None
        return fold_in_rank_order(self._recv.view(self._owner.world, self._length), self._owner.world)


def _object_device(group: dist.ProcessGroup) -> torch.device:
    """Where :meth:`Collectives.all_gather_objects` puts its byte tensors: the host where the group's backend
    has gloo (``gloo`` or ``cpu:gloo,cuda:nccl``), else the current accelerator (NCCL and its peers move device
    memory only)."""
    if "gloo" in str(dist.get_backend(group)) or not hasattr(torch, "accelerator"):
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


class Collectives:
    """The collectives of one engine over one process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        world_group = group if group is not None else dist.group.WORLD
        assert world_group is not None  # the engine refuses to build before init_process_group
        self.group: dist.ProcessGroup = world_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world)]
        self._object_device = _object_device(self.group)

    # ---- error translation -------------------------------------------------------------------------------
    def _fail(self, what: str, exc: BaseException) -> CollectiveError:
        return CollectiveError(
            f"collective {what} failed on rank {self.rank} of {self.world}: {exc}. Another rank most likely raised "
            f"or stopped calling the engine (every rank must make the same backward()/step() calls); see the "
            f"first failing rank's error"
        )

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CollectiveError:
            raise
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL report timeouts and peer loss as RuntimeError
            raise self._fail(what, exc) from exc

    def _wait(self, work: Any, what: str) -> None:
        self._call(what, work.wait)

    # ---- reductions --------------------------------------------------------------------------------------
    def start_reduce_scatter(
        self, contribution: torch.Tensor, splits: Sequence[int], what: str = "reduce-scatter"
    ) -> PendingReduce:
        """Start the rank-ordered reduce-scatter of ``contribution`` (this rank's already divided terms, a
        contiguous 1-D buffer whose consecutive ``splits[q]`` elements belong to rank q). Every rank must
        pass the same ``splits``; the result on rank r has ``splits[r]`` elements."""
        mine = int(splits[self.rank])
        if self.world == 1:
            return PendingReduce(self, None, contribution, mine, what)
        recv = torch.empty(self.world * mine, dtype=contribution.dtype, device=contribution.device)
        into, send = HANDOFF.lend(recv, contribution)
        work = self._call(
            what,
            lambda: dist.all_to_all_single(
                into, send, [mine] * self.world, [int(s) for s in splits], group=self.group, async_op=True
            ),
        )
        return PendingReduce(self, work, recv, mine, what)

    def all_gather_into(self, output: torch.Tensor, part: torch.Tensor, what: str = "all-gather") -> None:
        """``output`` (``world * part.numel()`` elements) receives every rank's ``part`` in rank order."""
        if self.world == 1:
            output.copy_(part)
            return
        into, send = HANDOFF.lend(output, part)
        self._call(what, lambda: _all_gather(into, send, self.group))

    def start_broadcasts(self, pieces: Sequence[tuple[int, torch.Tensor]], what: str = "gather") -> list[Any]:
        """Post, for each ``(owner, tensor)``, the broadcast of the owner's tensor into everyone's; returns the
        works for :meth:`wait_all` (ZeRO-3 gathers and their prefetch)."""
        if self.world == 1:
            return []
        works = []
        for owner, t in pieces:
            if t.numel() == 0:
                continue
            src = self._global[owner]
            (t,) = HANDOFF.lend(t)
            works.append(
                self._call(what, functools.partial(dist.broadcast, t, src, group=self.group, async_op=True))
            )
        return works

    def wait_all(self, works: Sequence[Any], what: str) -> None:
        for w in works:
            self._wait(w, what)

    def broadcast_pieces(self, pieces: Sequence[tuple[int, torch.Tensor]], what: str = "gather") -> None:
        """:meth:`start_broadcasts` and wait."""
        self.wait_all(self.start_broadcasts(pieces, what), what)

    def sum_floats_in_rank_order(self, value: float, device: torch.device, what: str = "norm") -> float:
        """Every rank's fp64 ``value`` added in rank order as Python floats (R14's cross-rank sum)."""
        if self.world == 1:
            return fold_left((value,))
        mine = torch.tensor([value], dtype=torch.float64, device=device)
        out = torch.empty(self.world, dtype=torch.float64, device=device)
        self.all_gather_into(out, mine, what)
        return fold_left(out.cpu().tolist())

    def all_gather_objects(self, obj: Any, what: str = "object all-gather") -> list[Any]:
        """Every rank's picklable ``obj`` in rank order (checkpoint agreement: tags, per-rank errors). Pickled
        into byte tensors of its own rather than through ``dist.all_gather_object``, whose temporaries the
        transport could release last (see :class:`TransportHandoff`)."""
        if self.world == 1:
            return [obj]
        dev = self._object_device
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
        sizes = torch.empty(self.world, dtype=torch.int64, device=dev)
        self.all_gather_into(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=dev), what)
        lengths = [int(n) for n in sizes.cpu().tolist()]
        longest = max(lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[: payload.numel()].copy_(payload)
        gathered = torch.empty(self.world * longest, dtype=torch.uint8, device=dev)
        self.all_gather_into(gathered, padded, what)
        rows = gathered.view(self.world, longest).cpu().contiguous()
        # each row's bytes straight from its memory (a manifest can be large; .tolist() is a Python int per byte)
        return [pickle.loads(ctypes.string_at(rows[r].data_ptr(), lengths[r])) for r in range(self.world)]

    def barrier(self, what: str = "barrier") -> None:
        if self.world > 1:
            self._call(what, lambda: dist.barrier(group=self.group))

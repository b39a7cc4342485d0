"""The asynchronous swap handle: worker threads, a bounded queue of file calls, O_DIRECT, pinned bounce pool.

Same API, records, rules and errors as :mod:`reference.io.handle` (read its docstring for the semantics); what
differs is how the bytes move:

- ``write``/``read`` return at once. A request is split into ``block_size`` file calls (``os.pwrite`` /
  ``os.preadv``, which release the GIL), and ``num_threads`` worker threads run at most ``queue_depth`` of them at
  a time, so one large tensor is streamed by several calls in parallel and many small requests overlap.
- Each request is three phases run by the workers: *prepare* (open, header checks, direct-or-bounce decision),
  its blocks (in any order, in parallel), *finish* (complete header, close, rename; or clean up on failure).
  Requests on the same path run one after another in submission order (so the create-or-update decision and
  read-after-write are race-free); requests on different paths overlap.
- Files are opened a second time with ``O_DIRECT`` when ``use_o_direct`` is on and the record's payload offset is
  4 KiB aligned; aligned blocks go through that descriptor, the header and a payload tail that is not a whole
  number of 4 KiB go through the buffered one. A filesystem that refuses ``O_DIRECT`` (EINVAL) makes the
  request run buffered and is counted in ``stats().o_direct_fallbacks`` with the reason.
- A tensor whose whole extent is in :mod:`optimized.ranges`' registry (any view of a native pinned buffer or of
  a :class:`optimized.slab.PinnedSlab` piece) is read into / written from directly; anything else goes through
  the handle's :class:`~optimized.io.pool.BouncePool`.

Failure handling: the first failing call marks the request failed; blocks not started are skipped, running ones
finish, then *finish* closes every descriptor, removes the temporary file (new files) or leaves the record marked
``WRITING`` (in-place updates), and returns every bounce buffer before ``wait()`` raises. ``close()`` drains the
queue, joins the workers and unpins the pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import itertools
import os
import stat
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from optimized.io.pool import BouncePool
from optimized.io.staging import Staging, byte_view, flat_bytes
from optimized.ranges import global_registry, tensor_extent
from reference.contract import io_record as record
from reference.contract.errors import HostOffloadError
from reference.contract.io_config import DIRECT_ALIGNMENT, SwapConfig
from reference.contract.io_errors import (
    HandleClosedError,
    ShortFileError,
    SwapError,
    swap_io_error,
    with_cause,
)
from reference.contract.io_stats import SwapStats
from reference.contract.io_temporaries import sweep_stale_temporaries, temporary_name
from reference.contract.io_transfer import (
    check_request,
    is_direct,
    tensor_nbytes,
)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
class RequestPhase(enum.Enum):
    """Where one request is in its three phases (the module docstring): waiting for *prepare*, being prepared, its
    blocks, its *finish*, done."""

    PREPARE = "prepare"
    PREPARING = "preparing"
    BLOCKS = "blocks"
    FINISH = "finish"
    DONE = "done"


@dataclass
class Transfer:
    """The engine's I/O state of one request: set by *prepare*, used by the blocks and *finish*, dropped when the
    request completes (so the engine keeps no reference to the caller's memory)."""

    #: the path, absolute: requests on one key run one after another
    key: str
    #: where the bytes are written to or read from: the path itself, or a temporary until a new file's rename
    target: str
    #: the caller's tensor as bytes, or its contiguous copy (a strided write gathered at submission)
    staging: Staging | None = None
    flat: torch.Tensor | None = None
    #: the bytes themselves, for a request that reads into / writes from its memory directly
    view: memoryview | None = None
    #: buffered and O_DIRECT descriptors (-1: not open)
    fd: int = -1
    dfd: int = -1
    #: a new file (written to a temporary, renamed by *finish*, removed on failure)
    created: bool = False
    #: (start, end) byte ranges of the payload, one per file call
    blocks: list[tuple[int, int]] = field(default_factory=list)
    #: bytes that went through the O_DIRECT descriptor (the stats count them)
    o_direct_bytes: int = 0

    def release_memory(self) -> None:
        self.staging = self.flat = self.view = None


class SwapRequest:
    """One write or read in flight. ``direct``/``o_direct`` are decided by the *prepare* phase (None before).

    The engine schedules it through its methods, under the engine's lock: :meth:`next_unit` claims the next unit
    of work (*prepare*, a block, *finish*), :meth:`unit_done` records one that ran, :meth:`complete` ends it;
    :attr:`transfer` holds its I/O state.
    """

    def __init__(self, handle: SwapEngine, seq: int, op: str, tensor: torch.Tensor, path: str, offset: int) -> None:
        self._handle = handle
        self.seq = seq
        self.op = op
        self.tensor = tensor
        self.path = path
        self.offset = offset
        self.nbytes = tensor_nbytes(tensor)
        self.direct: bool | None = None
        self.o_direct: bool | None = None
        self._error: HostOffloadError | None = None
        self._event = threading.Event()
        #: the engine's I/O state of this request
        self.transfer = Transfer(key=os.path.abspath(path), target=path)
        # Scheduling state, guarded by the engine's condition.
        self._phase = RequestPhase.PREPARE
        self._running = 0
        self._next_block = 0

    # -- scheduling (the engine calls these under its lock) ----------------------------------------------------
    @property
    def error(self) -> HostOffloadError | None:
        """The first error of any of its units (None: none failed so far)."""
        return self._error

    def next_unit(self) -> tuple[str, int] | None:
        """Claim this request's next unit of work -- ``("prepare", -1)``, ``("block", i)``, ``("finish", -1)`` --
        or None (it has none to give now: being prepared, blocks running, done)."""
        if self._phase is RequestPhase.PREPARE:
            self._phase = RequestPhase.PREPARING  # nothing else of this request runs until prepare is done
            self._running += 1
            return "prepare", -1
        if self._phase is RequestPhase.BLOCKS:
            if self._error is None and self._next_block < len(self.transfer.blocks):
                i = self._next_block
                self._next_block += 1
                self._running += 1
                return "block", i
            if self._running == 0:  # every block ran (or a failure stopped the rest): finish
                self._phase = RequestPhase.FINISH
                self._running += 1
                return "finish", -1
        return None

    def unit_done(self, unit: str, error: HostOffloadError | None) -> bool:
        """Record that ``unit`` ran (with ``error``, the request's first one is kept); True when it was *finish*
        (then :meth:`complete` follows)."""
        self._running -= 1
        if error is not None and self._error is None:
            error.request = self
            self._error = error
        if unit == "prepare":
            self._phase = RequestPhase.BLOCKS
        return unit == "finish"

    def complete(self) -> None:
        """Done: drop the engine's references to the caller's memory and wake the waiters."""
        self._phase = RequestPhase.DONE
        self.transfer.release_memory()
        self._event.set()

    # -- the caller's API -----------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> HostOffloadError | None:
        self._event.wait(timeout)
        return self._error

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until the request is finished; return the tensor or raise its error (every time)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"swap request {self!r} still running after {timeout} s")
        if self._error is not None:
            self._handle._mark_reported(self)
            raise self._error
        return self.tensor

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self.done() else "pending")
        return f"<SwapRequest {self.op} {self.nbytes} B {self.path!r}@{self.offset} {state}>"


def _load_fallocate():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not glibc/Linux
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return fn


_fallocate = _load_fallocate()


def _reserve(fd: int, end: int) -> None:
    """Give the file its final size before the payload is written, blocks allocated where the filesystem can.

    Why: parallel O_DIRECT writes past end-of-file are serialised by ext4 and XFS (each one moves the size), writes
    inside the size are not; and a full disk fails here, before any byte of payload moved. ``fallocate`` (not
    ``posix_fallocate``, which glibc emulates by writing zeros where the filesystem lacks it) with a plain
    ``ftruncate`` fallback. The size equals the one the writes would produce, so the file is the same either way.
    """
    size = os.fstat(fd).st_size
    if end <= size:
        return
    if _fallocate is not None:
        if _fallocate(fd, 0, size, end - size) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, end)


def _open_seekable(path: str, flags: int) -> int:
    """``os.open`` that can never block on a FIFO: the submit-time check refuses FIFOs, sockets and directories,
    but the path may have been replaced since. ``O_NONBLOCK`` makes the open itself return (ENXIO for a FIFO
    without a reader) and the ``fstat`` refuses what still is not a file; for regular files it changes nothing."""
    fd = os.open(path, flags | _O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise SwapError(f"{path!r} became a FIFO or socket after the request was submitted; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        if n <= 0:  # pragma: no cover - the kernel reports errors by raising
            raise OSError(errno.EIO, "pwrite made no progress")
        view = view[n:]
        pos += n


def _pread_all(fd: int, view: memoryview, pos: int, path: str) -> None:
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            raise ShortFileError(f"{path!r} ended while reading at byte {pos} (truncated during the read?)")
        view = view[n:]
        pos += n


class SwapEngine:
    """Workers, queue and pool behind a :class:`SwapHandle`.

    Kept apart from the handle so that the worker threads hold no reference to the handle: a handle dropped
    without ``close()`` is garbage-collected and its finalizer closes the engine, so no thread outlives it.
    """

    def __init__(
        self,
        queue_depth: int = SwapConfig.queue_depth,
        block_size: int = SwapConfig.block_size,
        num_threads: int = SwapConfig.num_threads,
        use_o_direct: bool = SwapConfig.use_o_direct,
    ) -> None:
        self.config = SwapConfig(queue_depth, block_size, num_threads, use_o_direct)
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._chains: dict[str, deque[SwapRequest]] = {}
        self._active: list[SwapRequest] = []  # heads of their path's chain, in submission order
        self._pending: set[SwapRequest] = set()
        self._unreported: list[SwapRequest] = []
        self._calls_in_flight = 0
        self._closing = False
        self._closed = False
        self._pool = BouncePool(self.config.queue_depth, self.config.block_size)
        self._counts = dict.fromkeys(
            (
                "requests",
                "failed_requests",
                "bytes_written",
                "bytes_read",
                "direct_bytes",
                "bounced_bytes",
                "o_direct_bytes",
                "buffered_bytes",
                "o_direct_fallbacks",
            ),
            0,
        )
        self._fallback_reason = "" if use_o_direct else "use_o_direct=False"
        self._swept: set[str] = set()  # directories already swept of dead writers' temporaries
        self._threads = [
            threading.Thread(target=self._worker, name=f"hostoffload-swap-{i}", daemon=True)
            for i in range(self.config.num_threads)
        ]
        for t in self._threads:
            t.start()

    # -- submission ------------------------------------------------------------------------------------------
    def _submit(self, op: str, tensor: object, path: object, offset: object) -> SwapRequest:
        t, p, off = check_request(tensor, path, offset)
        # A strided tensor to write is gathered now, on the caller's thread and outside the lock: its values are
        # those at submission, and the workers are not held up by the copy.
        staging = Staging.for_write(t) if op == "write" else None
        with self._cond:
            if self._closing:
                raise HandleClosedError(f"{op}() on a closed SwapHandle")
            req = SwapRequest(self, next(self._seq), op, t, p, off)
            req.transfer.staging = staging
            self._pending.add(req)
            chain_ = self._chains.get(req.transfer.key)
            if chain_ is None:
                self._chains[req.transfer.key] = deque([req])
                self._active.append(req)
            else:
                chain_.append(req)
            self._cond.notify_all()
        return req

    # -- the engine ------------------------------------------------------------------------------------------
    def _pick_locked(self) -> tuple[SwapRequest, str, int] | None:
        """The next unit of work: (request, phase, block index), or None. Phases advance only here and in
        ``_worker``'s bookkeeping, both under the condition's lock."""
        for req in self._active:
            unit = req.next_unit()
            if unit is not None:
                return req, *unit
        return None

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    unit = self._pick_locked() if self._calls_in_flight < self.config.queue_depth else None
                    if unit is not None:
                        break
                    self._cond.wait()
                self._calls_in_flight += 1
            req, phase, index = unit
            error: HostOffloadError | None = None
            try:
                if phase == "prepare":
                    self._prepare(req)
                elif phase == "block":
                    self._block(req, index)
                else:
                    self._finish(req)
            except HostOffloadError as exc:  # a SwapError, or e.g. a bad pinning variable met by the bounce pool
                error = exc
            except OSError as exc:
                error = with_cause(swap_io_error(req.op, req.path, exc), exc)
            except Exception as exc:
                error = with_cause(SwapError(f"{req.op} {req.path!r} failed: {exc!r}"), exc)
            if error is not None and phase == "finish":
                # Finish failed (e.g. the rename): still release everything it did not get to.
                self._cleanup(req)
            with self._cond:
                self._calls_in_flight -= 1
                if req.unit_done(phase, error):
                    self._complete_locked(req)
                self._cond.notify_all()

    def _prepare(self, req: SwapRequest) -> None:
        """Open the file(s), check/mark the header, decide direct or bounce, list the blocks."""
        want_o_direct = (
            self.config.use_o_direct
            and _O_DIRECT != 0
            and req.offset % DIRECT_ALIGNMENT == 0
            and req.nbytes >= DIRECT_ALIGNMENT
        )
        if req.op == "write":
            staging = req.transfer.staging
            assert staging is not None
            exists = os.path.exists(req.path)
            req.transfer.created = not exists
            if not exists:
                self._sweep_once(os.path.dirname(req.transfer.key))
            req.transfer.target = req.path if exists else temporary_name(req.path)
            flags = os.O_WRONLY | _O_CLOEXEC | (0 if exists else os.O_CREAT | os.O_EXCL)
            req.transfer.fd = _open_seekable(req.transfer.target, flags)
            if exists:  # mark the record incomplete first: whatever fails after this reads as incomplete
                header = record.pack_header(staging.source.dtype, req.nbytes, record.STATE_WRITING)
                _pwrite_all(req.transfer.fd, memoryview(header), req.offset)
            if os.path.isfile(req.transfer.target):  # a regular file (not e.g. a device): reserve its final size
                _reserve(req.transfer.fd, req.offset + record.HEADER_SIZE + req.nbytes)
        else:
            req.transfer.fd = _open_seekable(req.path, os.O_RDONLY | _O_CLOEXEC)
            size = os.fstat(req.transfer.fd).st_size
            end = req.offset + record.HEADER_SIZE
            if size < end:
                raise ShortFileError(
                    f"{req.path!r} has {size} bytes; a record at offset {req.offset} needs at least {end}"
                )
            raw = bytearray(record.HEADER_SIZE)
            _pread_all(req.transfer.fd, memoryview(raw), req.offset, req.path)
            record.check_header(bytes(raw), req.tensor.dtype, req.nbytes, req.path, req.offset)
            if size < end + req.nbytes:
                raise ShortFileError(
                    f"{req.path!r} has {size} bytes; the {req.nbytes}-byte record at offset {req.offset} needs "
                    f"{end + req.nbytes}"
                )
            staging = Staging.for_read(req.tensor)
        req.o_direct = False
        if want_o_direct:
            try:
                req.transfer.dfd = os.open(req.transfer.target, (os.O_WRONLY if req.op == "write" else os.O_RDONLY)
                                   | _O_CLOEXEC | _O_DIRECT)
                req.o_direct = True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                with self._cond:
                    self._counts["o_direct_fallbacks"] += 1
                    self._fallback_reason = (
                        f"O_DIRECT refused for {req.path!r} ({exc.strerror}); that request ran buffered"
                    )
        source = staging.source
        req.direct = is_direct(source, global_registry().contains, tensor_extent, req.o_direct)
        req.transfer.flat = flat_bytes(source) if req.nbytes else None
        req.transfer.view = byte_view(source) if req.direct else None
        req.transfer.blocks = [(a, min(a + self.config.block_size, req.nbytes))
                       for a in range(0, req.nbytes, self.config.block_size)]
        req.transfer.staging = staging

    def _block(self, req: SwapRequest, index: int) -> None:
        a, b = req.transfer.blocks[index]
        n = b - a
        pos = req.offset + record.HEADER_SIZE + a
        # Aligned head through O_DIRECT, any sub-4 KiB tail through the page cache.
        head = n - n % DIRECT_ALIGNMENT if req.o_direct else 0
        if req.direct:
            assert req.transfer.view is not None  # _prepare gives a direct request its view
            view = req.transfer.view[a:b]
            self._io(req, view, pos, head)
            return
        flat = req.transfer.flat
        assert flat is not None  # _prepare gives a request with blocks its bytes
        slot, bounce = self._pool.acquire()
        try:
            bview = byte_view(bounce)[:n]
            if req.op == "write":
                bounce[:n].copy_(flat[a:b])
                self._io(req, bview, pos, head)
            else:
                self._io(req, bview, pos, head)
                flat[a:b].copy_(bounce[:n])
        finally:
            self._pool.release(slot)

    def _io(self, req: SwapRequest, view: memoryview, pos: int, head: int) -> None:
        if req.op == "write":
            if head:
                _pwrite_all(req.transfer.dfd, view[:head], pos)
            if head < len(view):
                _pwrite_all(req.transfer.fd, view[head:], pos + head)
        else:
            if head:
                _pread_all(req.transfer.dfd, view[:head], pos, req.path)
            if head < len(view):
                _pread_all(req.transfer.fd, view[head:], pos + head, req.path)
        if head:
            with self._cond:
                req.transfer.o_direct_bytes += head

    def _finish(self, req: SwapRequest) -> None:
        staging = req.transfer.staging
        if req.error is None:
            assert staging is not None  # every request that did not fail was prepared
            if req.op == "write":
                header = record.pack_header(staging.source.dtype, req.nbytes, record.STATE_COMPLETE)
                _pwrite_all(req.transfer.fd, memoryview(header), req.offset)
            self._close_fds(req)
            if req.op == "write" and req.transfer.created:
                os.replace(req.transfer.target, req.path)
                req.transfer.created = False
            elif req.op == "read":
                staging.finish_read()
        else:
            self._cleanup(req)

    def _sweep_once(self, directory: str) -> None:
        """Remove dead writers' temporaries from ``directory`` the first time this handle creates a file there."""
        with self._cond:
            if directory in self._swept:
                return
            self._swept.add(directory)
        sweep_stale_temporaries(directory)

    def _close_fds(self, req: SwapRequest) -> None:
        tr = req.transfer
        for attr in ("dfd", "fd"):
            fd = getattr(tr, attr)
            if fd >= 0:
                setattr(tr, attr, -1)
                os.close(fd)

    def _cleanup(self, req: SwapRequest) -> None:
        """Failure path: close what is open and remove a temporary file. Never raises."""
        try:
            self._close_fds(req)
        except OSError:
            pass
        if req.op == "write" and req.transfer.created:
            req.transfer.created = False
            try:
                os.unlink(req.transfer.target)
            except OSError:
                pass

    def _complete_locked(self, req: SwapRequest) -> None:
        c = self._counts
        c["requests"] += 1
        if req.error is not None:
            c["failed_requests"] += 1
            self._unreported.append(req)
        else:
            c["bytes_written" if req.op == "write" else "bytes_read"] += req.nbytes
            c["direct_bytes" if req.direct else "bounced_bytes"] += req.nbytes
            c["o_direct_bytes"] += req.transfer.o_direct_bytes
            c["buffered_bytes"] += req.nbytes - req.transfer.o_direct_bytes
        self._pending.discard(req)
        self._active.remove(req)
        chain_ = self._chains[req.transfer.key]
        chain_.popleft()
        if chain_:
            nxt = chain_[0]
            pos = next((i for i, r in enumerate(self._active) if r.seq > nxt.seq), len(self._active))
            self._active.insert(pos, nxt)
        else:
            del self._chains[req.transfer.key]
        req.complete()  # drops the engine's references to the caller's memory, wakes the waiters

    # -- waiting, stats, lifetime ----------------------------------------------------------------------------
    def _mark_reported(self, req: SwapRequest) -> None:
        with self._cond:
            if req in self._unreported:
                self._unreported.remove(req)

    def wait(self, request: SwapRequest | None = None) -> None:
        """Wait for ``request``, or for every request submitted so far; raise the first failure not yet raised.

        With several failures the first (in submission order) is raised and the others are listed on it as
        ``other_failures``; each request keeps its own error (``request.wait()`` raises it again).
        """
        if request is not None:
            request.wait()
            return
        with self._cond:
            pending = list(self._pending)
        for req in pending:
            req.exception()  # waits; the errors are collected below
        with self._cond:
            failed = sorted(self._unreported, key=lambda r: r.seq)
            self._unreported = []
        if failed:
            first = failed[0].error
            assert first is not None  # only failed requests are unreported
            first.other_failures = [r.error for r in failed[1:]]
            raise first

    def stats(self) -> SwapStats:
        with self._cond:
            c = dict(self._counts)
            in_flight = len(self._pending)
            reason = self._fallback_reason
        return SwapStats(
            requests=c["requests"],
            failed_requests=c["failed_requests"],
            bytes_written=c["bytes_written"],
            bytes_read=c["bytes_read"],
            direct_bytes=c["direct_bytes"],
            bounced_bytes=c["bounced_bytes"],
            o_direct_bytes=c["o_direct_bytes"],
            buffered_bytes=c["buffered_bytes"],
            o_direct_requested=self.config.use_o_direct,
            o_direct_fallbacks=c["o_direct_fallbacks"],
            fallback_reason=reason,
            pool_bytes=self._pool.nbytes,
            pool_pinned=self._pool.pinned,
            bounce_in_use=self._pool.in_use,
            threads=sum(t.is_alive() for t in self._threads),
            in_flight=in_flight,
        )

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Finish every queued request (their errors stay on them), stop the workers, unpin the pool.
        Idempotent."""
        with self._cond:
            if self._closing:
                already = True
            else:
                already = False
                self._closing = True
            pending = list(self._pending)
        for req in pending:
            req.exception()  # waits; the errors are collected below
        if already:
            for t in self._threads:
                t.join()
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._pool.close()


class SwapHandle:
    """An asynchronous swap handle (see the module docstring). Use as a context manager or call ``close()``.

    ``queue_depth``: file calls in flight at once (and bounce buffers in the pool); ``block_size``: bytes per
    call and per bounce buffer; ``num_threads``: worker threads; ``use_o_direct``: O_DIRECT where allowed.
    """

    def __init__(
        self,
        queue_depth: int = SwapConfig.queue_depth,
        block_size: int = SwapConfig.block_size,
        num_threads: int = SwapConfig.num_threads,
        use_o_direct: bool = SwapConfig.use_o_direct,
    ) -> None:
        self._engine = SwapEngine(queue_depth, block_size, num_threads, use_o_direct)
        self.config = self._engine.config
        self._finalizer = weakref.finalize(self, self._engine.close)

    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequest:
        """Queue storing ``tensor`` as a record at ``offset`` of ``path``; errors are raised by ``wait()``.

        ``tensor`` must not be modified until the request is waited on (a strided tensor is gathered at once)."""
        return self._engine._submit("write", tensor, path, offset)

    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequest:
        """Queue filling ``tensor`` from the record at ``offset`` of ``path``; errors are raised by ``wait()``."""
        return self._engine._submit("read", tensor, path, offset)

    def wait(self, request: SwapRequest | None = None) -> None:
        """Wait for ``request``, or for every request submitted so far; raise the first failure not yet raised
        (the others are listed on it as ``other_failures``)."""
        self._engine.wait(request)

    def stats(self) -> SwapStats:
        return self._engine.stats()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def close(self) -> None:
        """Finish every queued request (their errors stay on them), stop the workers, unpin the pool."""
        self._finalizer()

    def __enter__(self) -> SwapHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.wait()
        finally:
            self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<optimized SwapHandle {'closed' if self.closed else 'open'} queue_depth={c.queue_depth} "
            f"block_size={c.block_size} num_threads={c.num_threads} use_o_direct={c.use_o_direct}>"
        )

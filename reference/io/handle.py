"""The reference swap handle: every request runs to completion, in the caller's thread, through Python file
objects.

It is the executable specification of the area: the same arguments, the same on-disk records
(:mod:`reference.contract.io_record`), the same direct-versus-bounce rule (:mod:`reference.contract.io_transfer`)
and the same errors (raised by ``wait()``, never by ``write``/``read`` themselves, exactly where an asynchronous
handle raises them) as :mod:`optimized.io`, with none of the speed: one bounce buffer, no threads, no
``O_DIRECT``. It may be called from several threads; their requests run one at a time.

Semantics both implementations follow:

- ``write(tensor, path, offset=0)`` stores ``tensor``'s bytes as a record at byte ``offset`` of ``path``. A file
  that does not exist yet is built under a temporary name in the same directory and renamed onto ``path`` only
  when the whole record is written, so a failed write leaves no file at ``path``. An existing file is updated
  in place: the record's header is first marked ``WRITING``, then the payload is written, then the header is
  marked complete, so a write that fails half way leaves a record that reads as
  :class:`~reference.contract.io_errors.IncompleteRecordError`, never as data.
- ``read(tensor, path, offset=0)`` fills ``tensor`` from the record at ``offset`` after checking that it is a
  complete record of the same dtype and byte count. On failure the tensor's contents are unspecified.
- Requests on the same path take effect in submission order; the tensor of a pending request must not be
  touched by the caller until the request is waited on.
- Bad arguments raise :class:`~reference.contract.errors.ConfigurationError` at once; everything else is stored on the
  request and raised by ``request.wait()`` / ``handle.wait()``.
"""

from __future__ import annotations

import os
import threading

import torch

from reference.contract import envvars
from reference.contract import io_record as record
from reference.contract.accelerators import get_accelerator
from reference.contract.errors import HostOffloadError, PinnedMemoryLockError
from reference.contract.io_config import SwapConfig
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
from reference.io.staging import (
    Staging,
    blocks,
    byte_view,
    flat_bytes,
)
from reference.pinning import native_backend
from reference.ranges import global_registry, tensor_extent

_NO_O_DIRECT = "the reference handle uses buffered Python file objects; it never opens files with O_DIRECT"


class SwapRequest:
    """One write or read. ``direct`` says whether the tensor's own memory was used (None until decided);
    ``o_direct`` whether its file was open with ``O_DIRECT`` (always False here)."""

    def __init__(self, handle: SwapHandle, op: str, tensor: torch.Tensor, path: str, offset: int) -> None:
        self._handle = handle
        self.op = op
        self.tensor = tensor
        self.path = path
        self.offset = offset
        self.nbytes = tensor_nbytes(tensor)
        self.direct: bool | None = None
        self.o_direct: bool | None = None
        self._error: HostOffloadError | None = None

    def done(self) -> bool:
        return True

    def exception(self) -> HostOffloadError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Return the tensor, or raise the request's error (every time it is called)."""
        if self._error is not None:
            self._handle._mark_reported(self)
            raise self._error
        return self.tensor

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done"
        return f"<SwapRequest {self.op} {self.nbytes} B {self.path!r}@{self.offset} {state}>"


def _write_all(f, view: memoryview) -> None:
    while view:
        n = f.write(view)
        view = view[n:]


def _read_exact(f, view: memoryview, path: str) -> None:
    while view:
        n = f.readinto(view)
        if not n:
            raise ShortFileError(f"{path!r} ended while reading (truncated during the read?)")
        view = view[n:]


class SwapHandle:
    """A blocking swap handle (see the module docstring). Use as a context manager or call ``close()``."""

    def __init__(
        self,
        queue_depth: int = SwapConfig.queue_depth,
        block_size: int = SwapConfig.block_size,
        num_threads: int = SwapConfig.num_threads,
        use_o_direct: bool = SwapConfig.use_o_direct,
    ) -> None:
        self.config = SwapConfig(queue_depth, block_size, num_threads, use_o_direct)
        self._lock = threading.Lock()
        self._closed = False
        self._bounce: torch.Tensor | None = None
        self._bounce_pinned = False
        self._counts = dict.fromkeys(
            ("requests", "failed_requests", "bytes_written", "bytes_read", "direct_bytes", "bounced_bytes"), 0
        )
        self._unreported: list[SwapRequest] = []
        self._swept: set[str] = set()  # directories already swept of dead writers' temporaries

    # -- requests -------------------------------------------------------------------------------------------
    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequest:
        """Store ``tensor`` as a record at ``offset`` of ``path``; errors are raised by ``wait()``."""
        return self._submit("write", tensor, path, offset)

    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequest:
        """Fill ``tensor`` from the record at ``offset`` of ``path``; errors are raised by ``wait()``."""
        return self._submit("read", tensor, path, offset)

    def _submit(self, op: str, tensor: object, path: object, offset: object) -> SwapRequest:
        t, p, off = check_request(tensor, path, offset)
        # One request at a time, whatever the number of calling threads: the handle has one bounce buffer, and
        # serialising is also the simplest way to honour "same path, submission order".
        with self._lock:
            if self._closed:
                raise HandleClosedError(f"{op}() on a closed SwapHandle")
            req = SwapRequest(self, op, t, p, off)
            try:
                if op == "write":
                    self._do_write(req)
                else:
                    self._do_read(req)
            except HostOffloadError as exc:  # a SwapError, or e.g. a bad pinning variable met by the bounce buffer
                self._fail(req, exc)
            except OSError as exc:
                self._fail(req, with_cause(swap_io_error(op, p, exc), exc))
            except Exception as exc:  # e.g. a device copy into the bounce buffer: still the request's failure
                self._fail(req, with_cause(SwapError(f"{op} {p!r} failed: {exc!r}"), exc))
            else:
                key = "bytes_written" if op == "write" else "bytes_read"
                self._counts[key] += req.nbytes
                self._counts["direct_bytes" if req.direct else "bounced_bytes"] += req.nbytes
            self._counts["requests"] += 1
            return req

    def _fail(self, req: SwapRequest, exc: HostOffloadError) -> None:
        exc.request = req
        req._error = exc
        self._counts["failed_requests"] += 1
        self._unreported.append(req)

    def _decide(self, req: SwapRequest, staging: Staging) -> bool:
        req.o_direct = False
        req.direct = is_direct(staging.source, global_registry().contains, tensor_extent, o_direct=False)
        return req.direct

    def _do_write(self, req: SwapRequest) -> None:
        staging = Staging.for_write(req.tensor)
        direct = self._decide(req, staging)
        src = staging.source
        exists = os.path.exists(req.path)
        if not exists:
            directory = os.path.dirname(os.path.abspath(req.path))
            if directory not in self._swept:
                self._swept.add(directory)
                sweep_stale_temporaries(directory)
        target = req.path if exists else temporary_name(req.path)
        f = open(target, "r+b" if exists else "xb", buffering=0)
        old_size = os.fstat(f.fileno()).st_size
        try:
            if exists:
                f.seek(req.offset)
                _write_all(f, memoryview(record.pack_header(src.dtype, req.nbytes, record.STATE_WRITING)))
            f.seek(req.offset + record.HEADER_SIZE)
            if direct:
                view = byte_view(src)
                for a, b in blocks(req.nbytes, self.config.block_size):
                    _write_all(f, view[a:b])
            else:
                flat = flat_bytes(src)
                bounce = self._bounce_buffer()
                bview = byte_view(bounce)
                for a, b in blocks(req.nbytes, self.config.block_size):
                    bounce[: b - a].copy_(flat[a:b])
                    _write_all(f, bview[: b - a])
            f.seek(req.offset)
            _write_all(f, memoryview(record.pack_header(src.dtype, req.nbytes, record.STATE_COMPLETE)))
            f.close()
            if not exists:
                os.replace(target, req.path)
        except BaseException:
            # Give back every byte this write added: the temporary of a new file goes, an existing file that
            # grew keeps only up to the record's header (marked WRITING, so the record reads as incomplete,
            # never as data); a full disk would stay full otherwise.
            try:
                keep = max(old_size, req.offset + record.HEADER_SIZE)
                if exists and os.fstat(f.fileno()).st_size > keep:
                    os.ftruncate(f.fileno(), keep)
            except OSError:
                pass
            f.close()
            if not exists and os.path.exists(target):
                os.unlink(target)
            raise

    def _do_read(self, req: SwapRequest) -> None:
        staging = Staging.for_read(req.tensor)
        with open(req.path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            end = req.offset + record.HEADER_SIZE
            if size < end:
                raise ShortFileError(
                    f"{req.path!r} has {size} bytes; a record at offset {req.offset} needs at least {end}"
                )
            f.seek(req.offset)
            raw = bytearray(record.HEADER_SIZE)
            _read_exact(f, memoryview(raw), req.path)
            record.check_header(bytes(raw), req.tensor.dtype, req.nbytes, req.path, req.offset)
            if size < end + req.nbytes:
                raise ShortFileError(
                    f"{req.path!r} has {size} bytes; the {req.nbytes}-byte record at offset {req.offset} needs "
                    f"{end + req.nbytes}"
                )
            direct = self._decide(req, staging)
            dst = staging.source
            if direct:
                view = byte_view(dst)
                for a, b in blocks(req.nbytes, self.config.block_size):
                    _read_exact(f, view[a:b], req.path)
            else:
                flat = flat_bytes(dst)
                bounce = self._bounce_buffer()
                bview = byte_view(bounce)
                for a, b in blocks(req.nbytes, self.config.block_size):
                    _read_exact(f, bview[: b - a], req.path)
                    flat[a:b].copy_(bounce[: b - a])
        staging.finish_read()

    # -- bounce buffer -----------------------------------------------------------------------------------
    def _bounce_buffer(self) -> torch.Tensor:
        """The handle's one bounce buffer, pinned by the native backend on first use (pageable if the lock
        limit refuses it: still correct, only slower)."""
        if self._bounce is None:
            try:
                self._bounce = native_backend.empty(
                    (self.config.block_size,),
                    torch.uint8,
                    get_accelerator(),
                    envvars.pin_register_device(),
                    global_registry(),
                )
                self._bounce_pinned = True
            except PinnedMemoryLockError:
                self._bounce = torch.empty(self.config.block_size, dtype=torch.uint8)
                self._bounce_pinned = False
        return self._bounce

    # -- waiting, stats, lifetime ------------------------------------------------------------------------
    def _mark_reported(self, req: SwapRequest) -> None:
        with self._lock:
            if req in self._unreported:
                self._unreported.remove(req)

    def wait(self, request: SwapRequest | None = None) -> None:
        """Wait for ``request``, or for every request submitted so far; raise the first failure not yet raised.

        With several failures, the first is raised and the others are listed on it as ``other_failures`` (each
        request keeps its own error: ``request.wait()`` raises it again).
        """
        if request is not None:
            request.wait()
            return
        with self._lock:
            failed, self._unreported = self._unreported, []
        if failed:
            first = failed[0]._error
            assert first is not None  # only failed requests are unreported
            first.other_failures = [r._error for r in failed[1:]]
            raise first

    def stats(self) -> SwapStats:
        c = self._counts
        bounce = self._bounce
        return SwapStats(
            requests=c["requests"],
            failed_requests=c["failed_requests"],
            bytes_written=c["bytes_written"],
            bytes_read=c["bytes_read"],
            direct_bytes=c["direct_bytes"],
            bounced_bytes=c["bounced_bytes"],
            o_direct_bytes=0,
            buffered_bytes=c["bytes_written"] + c["bytes_read"],
            o_direct_requested=self.config.use_o_direct,
            o_direct_fallbacks=0,
            fallback_reason=_NO_O_DIRECT if self.config.use_o_direct else "",
            pool_bytes=0 if bounce is None else bounce.numel(),
            pool_pinned=self._bounce_pinned,
            bounce_in_use=0,
            threads=0,
            in_flight=0,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the bounce buffer (unpinned now, freed with its last reference). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bounce, self._bounce = self._bounce, None
        if bounce is not None and self._bounce_pinned:
            ptr, nbytes = tensor_extent(bounce)
            alloc = native_backend.allocation_of(ptr, nbytes, global_registry())
            if alloc is not None:
                alloc.unpin()
        self._bounce_pinned = False
        del bounce

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
            f"<reference SwapHandle {'closed' if self._closed else 'open'} queue_depth={c.queue_depth} "
            f"block_size={c.block_size} num_threads={c.num_threads} use_o_direct={c.use_o_direct}>"
        )

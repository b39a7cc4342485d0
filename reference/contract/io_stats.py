"""The statistics a swap handle reports (``SwapHandle.stats()``), as one type for every implementation.

Contract, not oracle: the suite reads these fields to check the direct-versus-bounce rule
(:mod:`reference.contract.io_transfer`), the O_DIRECT fallback and that a closed handle holds no pool or thread;
users compare the numbers across implementations. The fields and their meaning are fixed here; each handle
counts with its own code.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SwapStats"]


class SwapStats(NamedTuple):
    """What a handle has done so far.

    ``requests``/``failed_requests``: requests finished (successfully or not) and those that failed.
    ``bytes_written``/``bytes_read``: payload bytes of successful requests.
    ``direct_bytes``/``bounced_bytes``: payload bytes moved straight from/to the caller's tensor versus through a
    bounce buffer (successful requests). ``o_direct_bytes``/``buffered_bytes``: payload bytes that went through an
    ``O_DIRECT`` descriptor versus the page cache. ``o_direct_requested``: the handle's ``use_o_direct``.
    ``o_direct_fallbacks``: files the filesystem refused to open with ``O_DIRECT`` (the request then ran
    buffered); ``fallback_reason``: the last refusal, or why O_DIRECT is never tried ("" if it never fell back).
    ``pool_bytes``: bytes of bounce pool held now; ``pool_pinned``: whether the pool is page-locked (False if the
    lock limit forced pageable buffers); ``bounce_in_use``: bounce buffers checked out now (0 when idle);
    ``threads``: worker threads alive now; ``in_flight``: requests submitted and not finished.
    """

    requests: int
    failed_requests: int
    bytes_written: int
    bytes_read: int
    direct_bytes: int
    bounced_bytes: int
    o_direct_bytes: int
    buffered_bytes: int
    o_direct_requested: bool
    o_direct_fallbacks: int
    fallback_reason: str
    pool_bytes: int
    pool_pinned: bool
    bounce_in_use: int
    threads: int
    in_flight: int

"""The on-disk record: a 4 KiB header followed by the tensor's bytes.

Why a header rather than raw bytes: a raw file cannot tell a read that it is about to fill a float32 buffer with
bfloat16 state, or with a record whose write died half way. The header names the dtype and byte count and
carries a state word that is ``WRITING`` while the payload is incomplete, so a failed in-place update is reported
as :class:`~reference.contract.io_errors.IncompleteRecordError` instead of being read as data. It is exactly
:data:`HEADER_SIZE` bytes so that a record placed at a 4 KiB-aligned offset keeps its payload aligned for
``O_DIRECT``.

A file may hold several records at different offsets (``record_span`` says how far apart to place them);
records must not overlap, as in any file format.

Header layout (little endian): magic ``b"HOFFSWAP"``, u16 version, u16 state, u32 header size, u64 payload
bytes, 32-byte NUL-padded dtype name (``"float32"``), zero padding to 4096 bytes.

Contract: a file written by one implementation must be read by the other, so the bytes are defined once.
"""

from __future__ import annotations

import struct

import torch

from reference.contract.io_config import DIRECT_ALIGNMENT
from reference.contract.io_errors import DtypeMismatchError, IncompleteRecordError, RecordFormatError, SizeMismatchError

MAGIC = b"HOFFSWAP"
VERSION = 1
HEADER_SIZE = 4096
STATE_COMPLETE = 1
STATE_WRITING = 2

_FIELDS = struct.Struct("<8sHHIQ32s")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_header(dtype: torch.dtype, nbytes: int, state: int) -> bytes:
    """The full :data:`HEADER_SIZE`-byte header of a record."""
    name = dtype_name(dtype).encode("ascii")
    fields = _FIELDS.pack(MAGIC, VERSION, state, HEADER_SIZE, nbytes, name)
    return fields + bytes(HEADER_SIZE - len(fields))


def check_header(raw: bytes, dtype: torch.dtype, nbytes: int, path: str, offset: int) -> None:
    """Raise the precise :class:`~reference.contract.io_errors.RecordError` if ``raw`` is not a complete record of
    ``nbytes`` bytes of ``dtype``. Checks run in a fixed order (format, state, dtype, size) so every
    implementation reports the same error for the same file."""
    where = f"{path!r} at offset {offset}"
    if len(raw) < _FIELDS.size:
        raise RecordFormatError(f"no swap record at {where}: header cut short ({len(raw)} bytes)")
    magic, version, state, header_size, stored_nbytes, name = _FIELDS.unpack_from(raw)
    if magic != MAGIC or version != VERSION or header_size != HEADER_SIZE:
        raise RecordFormatError(
            f"no swap record at {where}: found magic {magic!r} version {version} header size {header_size}, "
            f"expected {MAGIC!r} version {VERSION} header size {HEADER_SIZE}"
        )
    if state != STATE_COMPLETE:
        raise IncompleteRecordError(
            f"the swap record at {where} is incomplete (state {state}): its write failed or has not finished"
        )
    stored_dtype = name.rstrip(b"\0").decode("ascii", "replace")
    if stored_dtype != dtype_name(dtype):
        raise DtypeMismatchError(
            f"the swap record at {where} holds dtype {stored_dtype}, the tensor to read into has dtype "
            f"{dtype_name(dtype)}"
        )
    if stored_nbytes != nbytes:
        raise SizeMismatchError(
            f"the swap record at {where} holds {stored_nbytes} bytes, the tensor to read into has {nbytes} bytes"
        )


def record_nbytes(nbytes: int) -> int:
    """File bytes taken by a record of ``nbytes`` payload bytes."""
    return HEADER_SIZE + nbytes


def record_span(nbytes: int, alignment: int = DIRECT_ALIGNMENT) -> int:
    """Distance from a record's offset to the next aligned offset where another record may start."""
    total = record_nbytes(nbytes)
    return -(-total // alignment) * alignment

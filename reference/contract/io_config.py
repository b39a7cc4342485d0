"""The knobs of a swap handle and their validation (what a handle reports: :mod:`reference.contract.io_stats`).

Both implementations take the same knobs with the same allowed values, so a configuration that works with the
reference works with the optimized handle and vice versa. The reference honours ``block_size`` (the size of its
one bounce buffer and of each file call) and validates the others, which only mean something to an asynchronous
engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.contract.errors import ConfigurationError

KIB = 1 << 10
MIB = 1 << 20

#: Alignment O_DIRECT needs for buffer address, file offset and length; 4 KiB covers 512 B and 4 KiB sectors.
DIRECT_ALIGNMENT = 4096

QUEUE_DEPTH_RANGE = (1, 1024)
NUM_THREADS_RANGE = (1, 64)
BLOCK_SIZE_RANGE = (4 * KIB, 256 * MIB)

DEFAULT_QUEUE_DEPTH = 8
DEFAULT_BLOCK_SIZE = 1 * MIB
DEFAULT_NUM_THREADS = 4


def _check_int_range(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigurationError(f"{name}={value!r} is not allowed; allowed values: an int from {lo} to {hi}")
    return value


def _check_block_size(value: object) -> int:
    lo, hi = BLOCK_SIZE_RANGE
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not lo <= value <= hi
        or value & (value - 1)
    ):
        raise ConfigurationError(
            f"block_size={value!r} is not allowed; allowed values: a power of two from {lo} (4 KiB) "
            f"to {hi} (256 MiB) bytes"
        )
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} is not allowed; allowed values: True, False")
    return value


@dataclass(frozen=True)
class SwapConfig:
    """Validated handle settings.

    ``queue_depth``: file calls in flight at once per handle (also the number of bounce buffers in the pool).
    ``block_size``: bytes per file call and per bounce buffer (a power of two, 4 KiB .. 256 MiB).
    ``num_threads``: worker threads issuing the calls. ``use_o_direct``: open files with ``O_DIRECT`` where the
    filesystem allows it (falls back to buffered I/O where it does not; the handle's stats say so).
    """

    queue_depth: int = DEFAULT_QUEUE_DEPTH
    block_size: int = DEFAULT_BLOCK_SIZE
    num_threads: int = DEFAULT_NUM_THREADS
    use_o_direct: bool = True

    def __post_init__(self) -> None:
        _check_int_range("queue_depth", self.queue_depth, *QUEUE_DEPTH_RANGE)
        _check_block_size(self.block_size)
        _check_int_range("num_threads", self.num_threads, *NUM_THREADS_RANGE)
        _check_bool("use_o_direct", self.use_o_direct)

__all__ = [
    "BLOCK_SIZE_RANGE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_NUM_THREADS",
    "DEFAULT_QUEUE_DEPTH",
    "DIRECT_ALIGNMENT",
    "KIB",
    "MIB",
    "NUM_THREADS_RANGE",
    "QUEUE_DEPTH_RANGE",
    "SwapConfig",
]

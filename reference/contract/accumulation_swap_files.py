"""Where ``offload_optimizer: nvme`` keeps the optimizer state between steps: the on-disk names (R17).

Shared by every implementation of the area because users, operators and the conformance suite look at these
files: each engine (or, in a multi-process run, each rank process) makes one private directory
``<nvme_path>/hostoffload-optstate-XXXXXXXX`` (so engines sharing a path never touch each other's files), holds
one file per (rank, state buffer) in it -- ``rank<r>.<buffer>.swp``, the buffer named as in
:func:`reference.contract.accumulation_step.state_buffer_names` -- and removes the directory when it is destroyed
or garbage collected. How the bytes move (blocking, asynchronous, direct) is each implementation's own.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["STATE_DIRECTORY_PREFIX", "make_state_directory", "state_file"]

#: The prefix of an engine's private directory under ``nvme_path``.
STATE_DIRECTORY_PREFIX = "hostoffload-optstate-"


def make_state_directory(nvme_path: str) -> str:
    """A fresh private state directory under ``nvme_path`` (created now; the caller removes it)."""
    return tempfile.mkdtemp(prefix=STATE_DIRECTORY_PREFIX, dir=nvme_path)


def state_file(directory: str, rank: int, name: str) -> str:
    """The file holding state buffer ``name`` of ``rank``'s partition."""
    return os.path.join(directory, f"rank{rank}.{name}.swp")

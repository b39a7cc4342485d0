"""The offload configuration: the shared contract object from the reference, re-exported unchanged.

Both implementations must accept and reject exactly the same knobs, so there is one class, not a copy.
"""

from reference.contract.offload_config import (
    MAX_BYTES,
    MAX_COUNT,
    MODE_ALL,
    MODE_CHECKPOINT_INPUTS,
    MODES,
    OffloadConfig,
)

__all__ = ["MAX_BYTES", "MAX_COUNT", "MODES", "MODE_ALL", "MODE_CHECKPOINT_INPUTS", "OffloadConfig"]

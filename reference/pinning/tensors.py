"""Argument checks and tensor predicates shared by the pinning backends.

They are contract rules every implementation shares; they live in :mod:`reference.contract.pinning_rules` and
are re-exported here under their historical names.
"""

from __future__ import annotations

from reference.contract.pinning_rules import (
    MAX_NBYTES,
    check_dtype,
    check_host_device,
    check_host_tensor,
    check_nbytes,
    check_tensor,
    is_data_less,
    normalize_shape,
)

__all__ = [
    "MAX_NBYTES",
    "check_dtype",
    "check_host_device",
    "check_host_tensor",
    "check_nbytes",
    "check_tensor",
    "is_data_less",
    "normalize_shape",
]

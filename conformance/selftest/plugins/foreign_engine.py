"""A distributed engine that is not hostoffload's: a vendor's subclass whose ``destroy()`` forgets the pinned
buffers it allocated (it drops them from its own list and keeps them alive elsewhere), so they are never
unpinned. hostoffload's engine passes the release test; this one must fail it, which proves the suite drives
the engine the implementation declares and not ours.

(A test double: it starts from the installed optimized engine because writing a whole ZeRO engine for a
self-test would prove nothing more. The suite itself never imports it; only this plugin's entry point does.)
"""

from __future__ import annotations

import torch

from optimized.accumulation import *  # noqa: F403 (the rest of the area API, unchanged)
from optimized.accumulation import ZeroEngine as _OptimizedZeroEngine

_FORGOTTEN: list[torch.Tensor] = []


class ZeroEngine(_OptimizedZeroEngine):
    def destroy(self) -> None:
        _FORGOTTEN.extend(self.__dict__.get("_pinned", ()))
        self._pinned = []
        super().destroy()

"""A distributed engine that is not hostoffload's: a vendor's subclass whose ``destroy()`` keeps a pinned copy of
every pinned buffer the engine held ("for post-mortem inspection") and never frees it, so pinned memory outlives
the engine. hostoffload's engine passes the release test; this one must fail it, which proves the suite drives
the engine the implementation declares and not ours.

(A test double: it starts from the installed optimized engine because writing a whole ZeRO engine for a
self-test would prove nothing more. It uses the engine's public ``pinned_buffers()`` and the public pinning API
only, so it keeps its defect whatever the engine's internals become. The suite itself never imports it; only
this plugin's entry point does.)
"""

from __future__ import annotations

import torch

from optimized.accumulation import *  # noqa: F403 (the rest of the area API, unchanged)
from optimized.accumulation import ZeroEngine as _OptimizedZeroEngine
from optimized.pinning import pin_memory

_FORGOTTEN: list[torch.Tensor] = []


class ZeroEngine(_OptimizedZeroEngine):
    def destroy(self) -> None:
        try:
            held = self.pinned_buffers()
        except AttributeError:  # a constructor that failed half-way: nothing to keep
            held = ()
        _FORGOTTEN.extend(pin_memory(t) for t in held)
        super().destroy()

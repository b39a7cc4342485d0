"""An implementation that leaves one call out and says so: the pinning API of the reference without
``pin_empty_like``, declared ``unsupported`` with a reason (``Implementation.unsupported``).

``conformance.selftest.test_contract_interfaces`` registers it by entry point (``selftest-partial``, not one of
the broken plugins of this package's ``ENTRY_POINTS``: nothing here is a defect) and checks that the interface
test passes without the name, that every test exercising the call is skipped with this reason, and that the
report shows it.
"""

from __future__ import annotations

from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation
from reference.pinning import PinnedStats, is_pinned, pin_empty, pin_memory, pinned_stats, unpin

__all__ = ["PinnedStats", "is_pinned", "pin_empty", "pin_memory", "pinned_stats", "unpin"]

REASON = "no shape-only allocation in this port yet"

PARTIAL = Implementation(
    name="selftest-partial",
    version="0.0.0",
    areas={"pinning": __name__},
    capabilities=Capabilities(pin_backends=("torch", "native"), crash_isolation=False),
    unsupported={"pinning.pin_empty_like": REASON},
)

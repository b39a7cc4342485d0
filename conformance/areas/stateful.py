"""Rules for hypothesis state machines over process-global state (the pinning registry, pinned allocations,
io handles): every example starts from the state the previous one left, so a teardown must release everything
the example created, and must not turn a failing example into a different failure.

Hypothesis calls ``teardown()`` from a ``finally`` clause. If a rule (or invariant) raised, an assertion in the
teardown would replace that exception: the shrinker then chases the teardown's symptom, the replay raises the
original again, and the run ends in ``Flaky`` instead of the real assertion. Teardowns therefore always release,
and check their end-of-example invariants only when :func:`rule_failed` is False.
"""

from __future__ import annotations

import sys


def rule_failed() -> bool:
    """True while ``teardown()`` runs because a rule or invariant raised (that exception is in flight)."""
    return sys.exc_info()[0] is not None

"""Setting and restoring environment variables, as the suite and its rank workers do.

The suite selects backends and accelerators through the environment, as a user would, and must leave the
environment as it found it. pytest's ``monkeypatch`` does that for one test function; this module serves the places
it cannot reach: fixtures shared across parametrizations, hypothesis tests (one function, many examples) and the
rank workers of ``conformance.harness.rank_pool``, which receive the variables to apply with each job.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def apply_environment(values: Mapping[str, str | None]) -> None:
    """Set each variable to its value, or remove it where the value is None (removing an unset one is no error)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextmanager
def patched_environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``apply_environment(values)`` for the block, then every named variable as it was before (set or unset),
    whatever the block changed in between."""
    saved = {name: os.environ.get(name) for name in values}
    apply_environment(values)
    try:
        yield
    finally:
        apply_environment(saved)

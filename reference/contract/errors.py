"""Errors shared by every hostoffload implementation.

Implementations raise these classes (or subclasses) so that the conformance suite, and users, can catch one
type whatever backend is underneath. Each class also derives from the builtin a Python user would expect
(``ValueError`` for a bad value, ``MemoryError`` for memory that cannot be locked), so existing ``except``
clauses keep working.

The swap-I/O errors live in :mod:`reference.contract.io_errors`; :mod:`reference.contract.public_errors` lists
every public error of the project once.

Contract: an ``except`` clause, and every test of the suite, names these classes; two implementations can only
be interchangeable if they raise the same ones.
"""

from __future__ import annotations

from collections.abc import Iterable


class HostOffloadError(Exception):
    """Base class of every error raised on purpose by hostoffload."""

    #: Set on the error a swap request failed with (reference.io, docs/io.md; a SwapError, or e.g. a
    #: ConfigurationError met while serving it): the failed request, and the failures a handle's wait() raised with it.
    request: object
    other_failures: list[HostOffloadError | None]


class ConfigurationError(HostOffloadError, ValueError):
    """A bad argument, config key or environment variable value.

    The message always names the argument (or variable) and the values it accepts.
    """


class PinnedMemoryLockError(HostOffloadError, MemoryError):
    """Host memory could not be page-locked (typically RLIMIT_MEMLOCK, see ``ulimit -l``).

    Raised only after everything allocated for the request has been released again.
    """


class PinnedAllocationError(HostOffloadError, MemoryError):
    """Host memory for a pinning call could not be allocated at all (before any page is locked): the size is more
    than the machine gives this process (available memory, the ``vm.overcommit_memory`` policy, ``RLIMIT_AS``).
    The message names the size and those limits. Raised with nothing allocated, locked or registered."""


class UnsupportedOperationError(HostOffloadError, RuntimeError):
    """A call that is valid in general but not in the current state or configuration."""


class CheckpointError(HostOffloadError, ValueError):
    """A checkpoint that cannot be loaded: missing, partial (a save that did not finish), or foreign (another
    model, another format). The message names the directory, the tag and what is wrong."""


class UnknownPluginError(ConfigurationError):
    """A named accelerator or implementation that no installed package provides."""


class MissingDependencyError(UnsupportedOperationError, ImportError):
    """An optional dependency needed for a requested feature is not installed."""


class CollectiveError(HostOffloadError, RuntimeError):
    """A collective failed or timed out, usually because another rank raised or stopped calling the engine."""


def allowed_values_error(name: str, value: object, allowed: Iterable[object]) -> ConfigurationError:
    """Build the standard message for a value outside an enumerated set.

    One helper keeps every such message in the same shape: what was given, where, and what would have
    been accepted.
    """
    choices = ", ".join(repr(a) if not isinstance(a, str) else a for a in allowed)
    return ConfigurationError(f"{name}={value!r} is not allowed; allowed values: {choices}")

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "ConfigurationError",
    "HostOffloadError",
    "MissingDependencyError",
    "PinnedAllocationError",
    "PinnedMemoryLockError",
    "UnknownPluginError",
    "UnsupportedOperationError",
    "allowed_values_error",
]

"""The error classes of hostoffload, importable from the implementation a user imports.

They are the shared contract's classes, listed once in :mod:`reference.contract.public_errors` (defined in
:mod:`reference.contract.errors` and :mod:`reference.contract.io_errors`), not copies: an
``except optimized.ConfigurationError`` catches what either implementation raises, and the conformance suite
checks both against the same classes.
"""

from __future__ import annotations

from reference.contract.public_errors import *  # noqa: F403  (the one list of the project's error classes)
from reference.contract.public_errors import __all__ as __all__

"""The error classes of hostoffload, importable from the reference as from ``optimized`` (``optimized.errors``).

They are the shared contract's classes, listed once in :mod:`reference.contract.public_errors` and re-exported
here unchanged: ``reference.ConfigurationError is optimized.ConfigurationError``.
"""

from __future__ import annotations

from reference.contract.public_errors import *  # noqa: F403  (the one list of the project's error classes)
from reference.contract.public_errors import __all__ as __all__

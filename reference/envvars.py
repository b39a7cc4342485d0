"""Environment variables that steer pinning, parsed at each use.

They are read at the first pinning call (and every call after), never at import: a bad value must surface where
the user pins memory, with a message naming the variable and its allowed values, and a test or a launcher may
change them between calls.
"""

from __future__ import annotations

import os

from reference.errors import allowed_values_error

PIN_BACKEND_ENV = "HOSTOFFLOAD_PIN_BACKEND"
PIN_BACKENDS: tuple[str, ...] = ("torch", "native")
DEFAULT_PIN_BACKEND = "torch"

REGISTER_DEVICE_ENV = "HOSTOFFLOAD_PIN_REGISTER_DEVICE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_VALUES: tuple[str, ...] = ("1", "0", "true", "false", "yes", "no", "on", "off")


def read_bool(name: str, default: bool) -> bool:
    """Parse a boolean variable: unset or empty -> default; case-insensitive on/off spellings; else an error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise allowed_values_error(name, raw, BOOL_VALUES)


def read_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Parse an enumerated variable: unset or empty -> default; exact (case-insensitive) match; else an error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise allowed_values_error(name, raw, choices)
    return value


def pin_backend() -> str:
    """The pinning backend selected by ``HOSTOFFLOAD_PIN_BACKEND`` (default ``torch``)."""
    return read_choice(PIN_BACKEND_ENV, PIN_BACKENDS, DEFAULT_PIN_BACKEND)


def register_with_device() -> bool:
    """Whether the native backend registers its pages with the device (``HOSTOFFLOAD_PIN_REGISTER_DEVICE``)."""
    return read_bool(REGISTER_DEVICE_ENV, True)

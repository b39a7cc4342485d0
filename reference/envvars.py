"""Environment variables that steer pinning, parsed at each use.

They are read at the first pinning call (and every call after), never at import: a bad value must surface where
the user pins memory, with a message naming the variable and its allowed values, and a test or a launcher may
change them between calls.

One rule for every ``HOSTOFFLOAD_*`` variable with named values (backends, accelerators, modes, booleans): the
value is read with surrounding blanks stripped and compared case-insensitively (``CPU``, ``Native`` and ``ON``
mean ``cpu``, ``native`` and ``on``); unset or empty means the default. Anything else is a
:class:`~reference.contract.errors.ConfigurationError` naming the variable and its allowed values. :func:`normalize` is
the rule; every reader here and in the implementations goes through it.

Every pinning variable is validated at every pinning call whatever the backend: a bad
``HOSTOFFLOAD_PIN_REGISTER_DEVICE`` is an error with the torch backend too, although only the native backend
uses it, so a typo never waits for the day the backend changes.
"""

from __future__ import annotations

import os

from reference.contract.errors import allowed_values_error

PIN_BACKEND_ENV = "HOSTOFFLOAD_PIN_BACKEND"
PIN_BACKENDS: tuple[str, ...] = ("torch", "native")
DEFAULT_PIN_BACKEND = "torch"

REGISTER_DEVICE_ENV = "HOSTOFFLOAD_PIN_REGISTER_DEVICE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_VALUES: tuple[str, ...] = ("1", "0", "true", "false", "yes", "no", "on", "off")


def normalize(raw: str | None) -> str | None:
    """The rule for named values: None for unset or blank, else the value stripped and lower-cased."""
    if raw is None:
        return None
    value = raw.strip().lower()
    return value or None


def read_bool(name: str, default: bool) -> bool:
    """Parse a boolean variable: unset or empty -> default; case-insensitive on/off spellings; else an error."""
    raw = os.environ.get(name)
    value = normalize(raw)
    if value is None:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise allowed_values_error(name, raw, BOOL_VALUES)


def read_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Parse an enumerated variable: unset or empty -> default; exact (case-insensitive) match; else an error."""
    raw = os.environ.get(name)
    value = normalize(raw)
    if value is None:
        return default
    if value not in choices:
        raise allowed_values_error(name, raw, choices)
    return value


def pin_backend() -> str:
    """The pinning backend selected by ``HOSTOFFLOAD_PIN_BACKEND`` (default ``torch``)."""
    return read_choice(PIN_BACKEND_ENV, PIN_BACKENDS, DEFAULT_PIN_BACKEND)


def register_with_device() -> bool:
    """Whether the native backend registers its pages with the device (``HOSTOFFLOAD_PIN_REGISTER_DEVICE``)."""
    return read_bool(REGISTER_DEVICE_ENV, True)


def check_pinning_environment() -> str:
    """Validate every pinning variable now, whatever the backend; return the selected backend."""
    backend = pin_backend()
    register_with_device()
    return backend

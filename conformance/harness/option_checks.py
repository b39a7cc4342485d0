"""The checks of a conformance session's options that need no torch: run by the ``pytest11`` entry point before
the plugin (torch, hypothesis, the accelerators) is even imported.

A usage error must cost the user one line and a fraction of a second, not the three seconds of importing torch
and hypothesis that :mod:`conformance.harness.plugin` pays. Everything that can be decided from the command line, the
environment and the installed distributions' metadata is decided here:

- ``$HOSTOFFLOAD_HYPOTHESIS_PROFILE`` names a profile (``--conformance-profile`` is checked by its ``choices``);
- every name given to ``--conformance-impl`` / ``--conformance-accelerator`` is an installed entry point (names
  are read from the metadata, no entry point is loaded);
- the ``--conformance-report`` directory can be created and written.

What needs the plugins themselves (whether a named accelerator is *available* here, whether an entry point loads
and gives what it promises) is checked by :mod:`conformance.harness.plugin` at configure time, still before any test
runs.
The messages are the plugin's own: both paths raise the same :class:`ConfigurationError` text.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

#: Spelled here as in conformance.harness.discovery / reference.contract.accelerators (the self-test
#: conformance/selftest/test_usage_errors.py checks they agree), so that this module imports neither.
IMPLEMENTATION_GROUP = "hostoffload.implementations"
ACCELERATOR_GROUP = "hostoffload.accelerators"


def split_names(values: list[str] | None) -> list[str]:
    """``--opt a,b --opt c`` -> ``[a, b, c]`` (blanks dropped), as conformance.harness.discovery reads the options."""
    out: list[str] = []
    for v in values or []:
        out.extend(p.strip() for p in v.split(",") if p.strip())
    return out


def installed_names(group: str) -> list[str]:
    """Entry-point names of ``group``, sorted and without duplicates, without loading any of them."""
    return sorted({ep.name for ep in entry_points(group=group)})


def unknown_names_error(flag: str, kind: str, unknown: list[str], known: list[str]) -> Exception:
    """The one message for names no installed package provides (also conformance.harness.discovery's)."""
    from reference.contract.errors import UnknownPluginError

    return UnknownPluginError(
        f"{flag} names unknown {kind}(s) {', '.join(unknown)}; allowed values: {', '.join(known)}"
    )


def _check_names(flag: str, kind: str, requested: list[str] | None, group: str) -> None:
    names = split_names(requested)
    if not names:
        return
    known = installed_names(group)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise unknown_names_error(flag, kind, unknown, known)


def check_report_option(path: str | None) -> None:
    """``--conformance-report DIR``: DIR is created and proven writable now (conformance.harness.report)."""
    from conformance.harness.report import check_report_dir
    from reference.contract.errors import ConfigurationError

    if not path:
        return
    try:
        check_report_dir(path)
    except OSError as exc:
        raise ConfigurationError(
            f"--conformance-report={path!r} is not a writable directory: {exc.strerror or exc}"
        ) from None


def check_options(config: pytest.Config) -> None:
    """Raise ConfigurationError (naming the option or variable and the allowed values) for a bad selection."""
    from conformance.harness import profiles

    profiles.choose_profile(config.getoption("conformance_profile", None))
    _check_names("--conformance-impl", "implementation", config.getoption("conformance_impl", None),
                 IMPLEMENTATION_GROUP)
    _check_names("--conformance-accelerator", "accelerator", config.getoption("conformance_accelerator", None),
                 ACCELERATOR_GROUP)
    check_report_option(config.getoption("conformance_report", None))

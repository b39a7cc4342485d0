"""The one rule every ``HOSTOFFLOAD_*`` variable follows (reference.contract.envvars), on each parser.

Stripped of surrounding blanks; unset or blank is the default; named values compare case-insensitively; numbers are
decimal; anything else is a ConfigurationError naming the variable. The suite checks that implementations react to
the variables (test_pinning_api and friends); this checks that every parser of the contract applies the same rule,
so a variable added later with its own ad-hoc parsing shows up here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conformance.harness import profiles
from reference.contract import envvars
from reference.contract.accelerators import get_accelerator
from reference.contract.errors import ConfigurationError

# (parser, variable, a spelling in another case with blanks around it, what it means)
SPELLINGS: list[tuple[Callable[[], object], str, str, object]] = [
    (envvars.pin_backend, envvars.PIN_BACKEND_ENV, " NATIVE ", "native"),
    (envvars.pin_register_device, envvars.PIN_REGISTER_DEVICE_ENV, "Off ", False),
    (envvars.pin_huge_pages, envvars.PIN_HUGE_PAGES_ENV, " THP", "thp"),
    (envvars.pin_register_overlap, envvars.PIN_REGISTER_OVERLAP_ENV, " No ", False),
    (envvars.accelerator_name, envvars.ACCELERATOR_ENV, " CPU ", "cpu"),
    (envvars.pin_populate_threads, envvars.PIN_POPULATE_THREADS_ENV, " 3 ", 3),
    (envvars.cpu_adam_threads, envvars.CPU_ADAM_THREADS_ENV, " 2\t", 2),
    (lambda: envvars.read_number(envvars.ACCUMULATION_TIMEOUT_ENV, 1.0, 60.0), envvars.ACCUMULATION_TIMEOUT_ENV,
     " 7.5 ", 7.5),
    (lambda: profiles.choose_profile(None), envvars.HYPOTHESIS_PROFILE_ENV, " Thorough ", "thorough"),
]

# (parser, variable, default when unset or blank, values it must refuse)
DEFAULTS: list[tuple[Callable[[], object], str, object, tuple[str, ...]]] = [
    (envvars.pin_backend, envvars.PIN_BACKEND_ENV, "torch", ("cuda", "native2", "1")),
    (envvars.pin_register_device, envvars.PIN_REGISTER_DEVICE_ENV, True, ("maybe", "2", "onn")),
    (envvars.pin_huge_pages, envvars.PIN_HUGE_PAGES_ENV, "auto", ("huge", "1")),
    (envvars.pin_register_overlap, envvars.PIN_REGISTER_OVERLAP_ENV, True, ("maybe",)),
    (envvars.accelerator_name, envvars.ACCELERATOR_ENV, None, ()),
    (envvars.pin_populate_threads, envvars.PIN_POPULATE_THREADS_ENV, 0, ("-1", "two", "1.5", "0x10")),
    (envvars.cpu_adam_threads, envvars.CPU_ADAM_THREADS_ENV, None, ("0", "-3", "many", "2.0")),
    (lambda: envvars.read_number(envvars.ACCUMULATION_TIMEOUT_ENV, 1.0, 60.0), envvars.ACCUMULATION_TIMEOUT_ENV,
     60.0, ("0.5", "soon", "inf", "nan")),
]


@pytest.mark.parametrize(("parse", "name", "raw", "expected"), SPELLINGS, ids=[s[1] for s in SPELLINGS])
def test_named_values_ignore_case_and_blanks(monkeypatch, parse, name, raw, expected) -> None:
    monkeypatch.setenv(name, raw)
    assert parse() == expected


@pytest.mark.parametrize(("parse", "name", "default", "bad"), DEFAULTS, ids=[d[1] for d in DEFAULTS])
def test_unset_or_blank_is_the_default_and_bad_values_name_the_variable(monkeypatch, parse, name, default, bad) -> None:
    monkeypatch.delenv(name, raising=False)
    assert parse() == default
    for blank in ("", "  ", "\t"):
        monkeypatch.setenv(name, blank)
        assert parse() == default, f"{name}={blank!r} must mean the default"
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigurationError) as info:
            parse()
        assert name in str(info.value) and "allowed values" in str(info.value), str(info.value)


def test_the_registry_follows_the_rule(monkeypatch) -> None:
    monkeypatch.setenv(envvars.ACCELERATOR_ENV, "  Cpu ")
    assert get_accelerator().name == "cpu"
    monkeypatch.setenv(envvars.ACCELERATOR_ENV, " ")
    assert get_accelerator() is not None  # blank: the default
    monkeypatch.setenv(envvars.ACCELERATOR_ENV, "no-such-device")
    with pytest.raises(ConfigurationError, match=envvars.ACCELERATOR_ENV):
        get_accelerator()


def test_the_harness_names_the_declared_variables() -> None:
    """The harness modules that must stay light spell their variable; it must be the one the contract declares."""
    from conformance.harness import engine_runner, isolation

    assert profiles.PROFILE_ENV == envvars.HYPOTHESIS_PROFILE_ENV
    assert isolation.CHILD_REPORTS_ENV == envvars.ISOLATED_REPORTS_ENV
    assert engine_runner.BACKEND_ENV == envvars.ACCUMULATION_BACKEND_ENV

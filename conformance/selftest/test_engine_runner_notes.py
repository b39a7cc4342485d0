"""The note the engine runner adds to a rank's error (which rank raised, its traceback) must not itself fail on
Python 3.10, which the package supports and which has no ``BaseException.add_note`` (3.11's): the type checker,
run at ``python_version = "3.10"``, found the runner calling it unconditionally, so a failing rank surfaced as an
``AttributeError`` that hid the rank's own error."""

from __future__ import annotations

import types

import pytest

from conformance.harness import engine_runner


class _Python310Error(Exception):
    """An exception as Python 3.10 builds it: no ``add_note``."""

    def __getattribute__(self, name: str) -> object:
        if name == "add_note":
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'add_note'")
        return super().__getattribute__(name)


def test_rank_note_on_python_310(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_runner, "sys", types.SimpleNamespace(version_info=(3, 10, 14)))
    exc = _Python310Error("rank 1 failed")
    engine_runner._add_note(exc, "raised on rank 1 of 2")
    engine_runner._add_note(exc, "rank traceback:\n...")
    assert exc.__notes__ == ["raised on rank 1 of 2", "rank traceback:\n..."]


def test_rank_note_on_python_311_and_later() -> None:
    exc = RuntimeError("rank 0 failed")
    engine_runner._add_note(exc, "raised on rank 0 of 2")
    assert exc.__notes__ == ["raised on rank 0 of 2"]

"""Running pytest (and python) in a child process, as a user or a vendor would, for the harness self-tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def source_root() -> Path | None:
    """The hostoffload source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it), else this file's checkout, if any."""
    env = os.environ.get("HOSTOFFLOAD_SOURCE_ROOT")
    for candidate in ([Path(env)] if env else []) + [Path(__file__).resolve().parents[2]]:
        if (candidate / "examples").is_dir():
            return candidate
    return None


def child_env(env: dict[str, str | None] | None = None) -> dict[str, str]:
    """os.environ with ``env`` applied; a None value removes the variable."""
    out = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_pytest(
    *args: str, env: dict[str, str | None] | None = None, cwd: Path | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=cwd,
    )


def run_python(code: str, env: dict[str, str | None] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env(env), cwd=cwd
    )


def last_lines(text: str, n: int) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]

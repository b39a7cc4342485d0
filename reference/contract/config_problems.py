"""Every problem of a config, collected and refused at once.

A DeepSpeed config copied from a tutorial typically has several keys this engine names differently, does not model,
or cannot resolve (HF's ``"auto"``). Refusing them one per error makes the user edit and rerun once per key; so the
DeepSpeed translation (:mod:`reference.contract.deepspeed_config`) records each problem here, with its dotted key and
what to write instead, and raises one :class:`ConfigurationError` that lists them all.

Contract: each entry names the key by its full dotted path (``zero_optimization.stage3_max_live_parameters``) and
says what is allowed instead; the entries are sorted by key so the message is the same whatever order the config's
dict had.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from reference.contract.errors import ConfigurationError

__all__ = ["ConfigProblems"]


class ConfigProblems:
    """The problems found so far, each ``(dotted key, message)``; :meth:`raise_if_any` refuses them together."""

    def __init__(self) -> None:
        self._items: list[tuple[str, str]] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def has(self, key: str) -> bool:
        """Whether ``key`` already has an entry (an unresolved "auto" is not also reported as missing)."""
        return any(k == key for k, _ in self._items)

    def add(self, key: str, message: str) -> None:
        """``key`` (dotted) is refused because ``message`` (which says what to put instead)."""
        self._items.append((key, message))

    def unknown_keys(self, where: str, given: Mapping[str, Any], allowed: Iterable[str],
                     hints: Mapping[str, str] | None = None) -> None:
        """One entry per key of ``given`` not in ``allowed``: its hint if ``hints`` has one, else the allowed keys."""
        allowed = tuple(allowed)
        hints = hints or {}
        for key in sorted(set(given) - set(allowed), key=str):
            dotted = f"{where}.{key}" if where else str(key)
            hint = hints.get(key)
            of = f" of {where}" if where else ""
            self.add(dotted, hint or f"unknown key; allowed keys{of}: {', '.join(allowed)}")

    def check(self, key: str, check: Callable[[], Any]) -> Any:
        """Run ``check``; a :class:`ConfigurationError` it raises becomes an entry for ``key`` (returns None then)."""
        try:
            return check()
        except ConfigurationError as exc:
            self.add(key, str(exc))
            return None

    def raise_if_any(self, what: str) -> None:
        """Refuse every problem recorded, in one error (sorted by key)."""
        if not self._items:
            return
        lines = "\n".join(f"  - {key}: {message}" for key, message in sorted(self._items))
        raise ConfigurationError(f"{what}: {len(self._items)} key(s) cannot be used as written:\n{lines}")

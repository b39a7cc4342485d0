"""Module attributes replaced for the duration of a block, and put back: what the filesystem fault injector
(:mod:`conformance.faults.checkpoint_faults`) and the filesystem call recorder (:mod:`conformance.faults.fs_trace`)
both do to ``os`` and ``builtins.open`` so that they see the calls a checkpoint save makes from outside the
implementation."""

from __future__ import annotations

from typing import Any


class AttributePatches:
    """Each :meth:`patch` remembers the attribute's value before it; :meth:`restore` puts every one back (the first
    value seen for an attribute, so patching one twice still restores the original)."""

    def __init__(self) -> None:
        self._saved: dict[tuple[Any, str], Any] = {}

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, value)

    def restore(self) -> None:
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        self._saved.clear()

"""Which live ZeroEngine wraps which module: one engine per model, and no reuse of a model a stage-3 engine emptied.

Why a registry: at stage 3 an engine installs hooks on every sub-module and replaces the parameters' data with its
partitions; a second engine over the same model (or over one of its sub-modules) would install a second set over
the first and the two would gather and release the same parameters under each other. After a stage-3 engine is
destroyed its model's parameters hold no data, so wrapping that model again would train on nothing. Both are
refused at construction with a :class:`ConfigurationError` (:func:`check_not_owned`). A :class:`ModuleClaim` is an
engine's entry in the registry; it is held by the engine (weakly referenced here), so an engine that is garbage
collected without ``destroy()`` frees its model too.
"""

from __future__ import annotations

import weakref

from torch import nn

from reference.contract.errors import ConfigurationError

__all__ = ["ModuleClaim", "check_not_owned"]

#: module -> weak reference to the claim of the live engine that wraps it (a module is owned by at most one engine).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
#: modules whose stage-3 parameters a destroyed engine left without data.
_RELEASED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_not_owned(module: nn.Module) -> None:
    """A module (or any of its sub-modules) already wrapped by a live engine cannot be wrapped again: at stage 3
    the first engine's hooks and partitions would fight the second's over the same parameters."""
    for m in module.modules():
        ref = _OWNERS.get(m)
        owner = ref() if ref is not None else None
        if owner is not None:
            what = "the model" if m is module else f"sub-module {type(m).__name__} of the model"
            raise ConfigurationError(
                f"model: {what} is already wrapped by another ZeroEngine (zero_stage={owner.stage}, rank "
                f"{owner.rank}); allowed: call destroy() on that engine first, or wrap a separate model"
            )
        if m in _RELEASED and any(p.numel() == 0 for p in m.parameters(recurse=False)):
            raise ConfigurationError(
                "model: its parameters were released by a destroyed zero_stage=3 engine and hold no data; allowed: "
                "a model with its parameters (load them back, e.g. from the old engine's state_dict())"
            )


class ModuleClaim:
    """One engine's hold on every module of ``module`` (registered on construction, dropped by :meth:`release`)."""

    def __init__(self, module: nn.Module, *, stage: int, rank: int) -> None:
        self.stage, self.rank = stage, rank
        self._module = module
        self._modules = list(module.modules())
        for m in self._modules:
            _OWNERS[m] = weakref.ref(self)

    def release(self) -> None:
        """The modules are free again; at stage 3 the model is remembered as emptied (its parameters hold no
        data until loaded back)."""
        for m in self._modules:
            ref = _OWNERS.get(m)
            if ref is not None and ref() is self:
                del _OWNERS[m]
        if self.stage == 3:
            _RELEASED.add(self._module)

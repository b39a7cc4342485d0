"""Offload contract: the in-place modification check for tensors saved through saved-tensor hooks.

Autograd checks the version counter of a saved tensor when backward unpacks it, and raises if the tensor was
modified in place after it was saved. It skips that check for saves that went through
``torch.autograd.graph.saved_tensors_hooks``, so every offload engine must do it itself, and must raise the same
error autograd raises: code and tests that match on autograd's wording keep working with offload enabled
(docs/offload.md, "Semantics that are part of the contract"). The wording is the shared rule, hence one
definition for every implementation.

A tensor that is moved to host must not be kept alive by the check (that would defeat the offload), so the check
holds a *version probe*: a detached alias whose storage is swapped for an empty one. It shares the tensor's version
counter but none of its memory.
"""

from __future__ import annotations

import torch


def version_probe(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter but none of its memory."""
    probe = t.detach()
    # ``.data =`` swaps the storage and metadata but keeps the version counter (and does not bump it).
    probe.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return probe


class SavedVersion:
    """What autograd's saved-variable check remembers about a tensor at save time, and the check itself.

    ``probe`` is any tensor sharing the saved tensor's version counter: the tensor itself (``detach()``-ed) when it
    stays where it is, :func:`version_probe` when its memory is to be given up.
    """

    __slots__ = ("grad_fn_name", "output_nr", "probe", "size", "type_name", "version")

    def __init__(self, t: torch.Tensor, probe: torch.Tensor) -> None:
        self.probe = probe
        self.version = t._version
        self.type_name = t.type()
        self.size = tuple(t.shape)
        grad_fn = t.grad_fn
        self.grad_fn_name = grad_fn.name() if grad_fn is not None else None
        self.output_nr = t.output_nr

    def check(self) -> None:
        """Raise autograd's error if the saved tensor was modified in place since it was saved."""
        current = self.probe._version
        if current != self.version:
            raise inplace_modified_error(
                self.type_name, self.size, self.grad_fn_name, self.output_nr, current, self.version
            )


def inplace_modified_error(
    type_name: str, size: tuple[int, ...], grad_fn_name: str | None, output_nr: int, current: int, saved: int
) -> RuntimeError:
    """The error autograd's SavedVariable check raises, word for word."""
    where = f", which is output {output_nr} of {grad_fn_name}," if grad_fn_name else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{type_name} [{', '.join(str(s) for s in size)}]]{where} is at version {current}; "
        f"expected version {saved} instead. Hint: enable anomaly detection to find the operation that "
        "failed to compute its gradient, with torch.autograd.set_detect_anomaly(True)."
    )

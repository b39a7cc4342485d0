"""Whether a loss was computed from an engine's module: the check ``ZeroEngine.backward`` runs first (R20).

A loss of another model, or of a detached output, would otherwise be accumulated as a silent zero-gradient
micro-step. A loss is the engine's when its autograd graph reaches one of the engine's trainable parameters (an
``AccumulateGrad`` node whose ``variable`` is one of them) or the autograd node of one of the module's outputs
(a forward that touched no trainable parameter, e.g. a routed-away expert, is still a legitimate micro-step).

Why the nodes are *marked* rather than remembered by ``id()``: the Python object of a C++ autograd node is a
wrapper, and its lifetime is torch's business. Up to torch 2.11 the node keeps only a borrowed pointer to its
wrapper, so the wrapper dies with its last Python reference and the next ``grad_fn`` / ``next_functions`` access
builds a new one, usually at another address, while the freed address is reused by other nodes' wrappers (torch
2.13 keeps the wrapper alive as long as the node). An ``id()`` remembered from a forward hook therefore named
nothing by the time of ``backward()``, and a breadth-first walk whose ``seen`` set held only ``id()`` of wrappers
it had already dropped skipped unvisited nodes that happened to get a recycled address -- on torch 2.11 it
rejected the engine's own losses. Here the mark is an entry of the node's ``metadata`` dict, which belongs to
the C++ node (every wrapper of it sees the same dict) and dies with the graph (no activation is kept alive), and
the walk holds every node it visited until it returns, so no address is recycled while it runs.

Parameters are compared by ``id()`` of the tensors themselves, which is sound: a tensor's Python object is kept
for as long as the tensor lives, and :class:`LossOrigin` holds the parameters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from reference.contract.errors import ConfigurationError

__all__ = ["LossOrigin", "tensors_in"]

#: The key of the mark in an autograd node's ``metadata`` dict (namespaced: anomaly mode and users share it).
MARK_KEY = "hostoffload.accumulation.engine_output"


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a module's output (nested tuples, lists and mappings)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from tensors_in(o)
    elif isinstance(output, Mapping):
        for o in output.values():
            yield from tensors_in(o)


class LossOrigin:
    """One engine's identity in autograd graphs: its trainable parameters and the mark of its module's outputs."""

    def __init__(self, trainable: Iterable[torch.Tensor]) -> None:
        self._params = tuple(trainable)  # held, so that their ids stay theirs
        self._param_ids = frozenset(id(p) for p in self._params)
        #: Unique per engine: outputs of another engine's module carry another token.
        self._token = object()

    def mark_outputs(self, output: Any) -> None:
        """Mark the autograd node of every tensor in a forward's ``output`` (a forward hook calls this)."""
        for t in tensors_in(output):
            node: Any = t.grad_fn  # Any: torch's stub types Node.metadata as a method; it is the node's dict
            if node is not None:
                node.metadata[MARK_KEY] = self._token

    def check_loss(self, loss: Any) -> None:
        """``backward(loss)``'s argument, refused before anything is accumulated: not a one-element tensor that
        requires grad, or not this engine's (:meth:`produced`: a foreign loss would accumulate a zero gradient)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ConfigurationError("loss must be a one-element tensor that requires grad")
        if not self.produced(loss):
            raise ConfigurationError(
                "loss was not computed from this engine's module: its autograd graph reaches neither a trainable "
                "parameter nor an output of engine.module (a loss of another model, or of a detached output, "
                "would be accumulated as a zero gradient); allowed: a loss computed from engine(...) / "
                "engine.module(...) outputs"
            )

    def produced(self, loss: torch.Tensor) -> bool:
        """Whether ``loss``'s graph reaches a marked output or a trainable parameter (breadth first: the usual
        loss is a few nodes from the model's output, so the walk ends at once)."""
        start = loss.grad_fn
        if start is None:
            return False
        visited = {id(start): start}  # id -> node: holding the node keeps its wrapper, so ids are not recycled
        queue = deque([start])
        while queue:
            # Any: torch's stub types Node.metadata as a method; at run time it is the node's dict
            node: Any = queue.popleft()
            if node.metadata.get(MARK_KEY) is self._token:
                return True
            var = getattr(node, "variable", None)
            if var is not None and id(var) in self._param_ids:
                return True
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in visited:
                    visited[id(nxt)] = nxt
                    queue.append(nxt)
        return False

"""Where the model-dtype parameters a ZeroEngine computes with live (R1, R12), and how an update reaches them.

Stages 0-2 keep the full parameters as views of one flat buffer, so the boundary's all-gather writes them in
place; stage 3 keeps only this rank's partitions (trainable and frozen; in pinned host memory with
``offload_param``) and the parameters hold no data between uses (:mod:`.stage3` gathers them). Update paths
(:mod:`.update_paths`) write this rank's new model-dtype partition through :meth:`LiveWeights.write`.
"""

from __future__ import annotations

import torch
from torch import nn

from optimized.accumulation.collectives import Collectives
from optimized.accumulation.host_buffers import HostBuffers
from reference.contract.accumulation_partition import FlatLayout

__all__ = ["LiveWeights"]


class LiveWeights:
    """This rank's storage of the model's parameters. ``flat`` (stages 0-2): the full trainable parameters, flat;
    ``part`` / ``frozen_part`` (stage 3): this rank's partitions. ``initial``: the trainable parameters of rank 0
    as flat after construction (every rank starts from them, R1), for the update path's master."""

    def __init__(
        self,
        *,
        stage: int,
        rank: int,
        layout: FlatLayout,
        frozen_layout: FlatLayout,
        device: torch.device,
        comm: Collectives,
        params: dict[str, nn.Parameter],
        host: HostBuffers,
        offload_param: bool,
        model_dtype: torch.dtype,
    ) -> None:
        self.stage, self.rank, self.layout, self.device, self._comm = stage, rank, layout, device, comm
        # Which buffers exist depends on the stage: the properties below hand them out, and refuse where absent.
        self._flat: torch.Tensor | None = None
        self._part: torch.Tensor | None = None
        self._frozen_part: torch.Tensor | None = None
        self._initial: torch.Tensor | None = None
        #: where stage-3 partitions live: pinned host memory with offload_param, else the device
        self.param_device = torch.device("cpu") if offload_param else device
        segments = {s.name: s for s in layout.segments}
        frozen_segments = {s.name: s for s in frozen_layout.segments}
        # R1: every rank starts from rank 0's parameters (the same model built from the same seed already is).
        flat = torch.zeros(layout.total, dtype=model_dtype, device=device)
        for n, s in segments.items():
            flat[s.offset : s.end].copy_(params[n].detach().reshape(-1))
        fflat = torch.zeros(frozen_layout.total, dtype=model_dtype, device=device)
        for n, s in frozen_segments.items():
            fflat[s.offset : s.end].copy_(params[n].detach().reshape(-1))
        comm.broadcast_pieces([(0, flat), (0, fflat)], "initial parameter broadcast")
        self._initial = flat
        if stage < 3:
            self._flat = flat
            for n, s in segments.items():
                params[n].data = flat[s.offset : s.end].view(s.shape)
            for n, s in frozen_segments.items():
                params[n].data = fflat[s.offset : s.end].view(s.shape).clone()
            return
        P, FP = layout.partition_size, frozen_layout.partition_size

        def partition(numel: int) -> torch.Tensor:
            if self.param_device.type == "cpu":
                return host.empty(numel, model_dtype, pinned=offload_param)
            return torch.empty(numel, dtype=model_dtype, device=self.param_device)

        self._part = partition(P)
        self._part.copy_(flat[rank * P : (rank + 1) * P])
        self._frozen_part = partition(FP)
        self._frozen_part.copy_(fflat[rank * FP : (rank + 1) * FP])

    @property
    def flat(self) -> torch.Tensor:
        """The full trainable parameters, flat (stages 0-2)."""
        return _present(self._flat, "flat", "stages 0-2")

    @property
    def part(self) -> torch.Tensor:
        """This rank's partition of the trainable parameters (stage 3)."""
        return _present(self._part, "part", "stage 3")

    @property
    def frozen_part(self) -> torch.Tensor:
        """This rank's partition of the frozen parameters (stage 3)."""
        return _present(self._frozen_part, "frozen_part", "stage 3")

    @property
    def initial(self) -> torch.Tensor:
        """Rank 0's trainable parameters, flat, until :meth:`drop_initial`."""
        return _present(self._initial, "initial", "construction, until drop_initial()")

    def drop_initial(self) -> None:
        """The update path has taken its master from :attr:`initial`; stage 3 no longer needs the full copy."""
        self._initial = None

    def close(self) -> None:
        """Drop every buffer (the engine's destroy: hooks a caller's autograd graph still holds keep nothing)."""
        self.__dict__.clear()

    def partition(self) -> torch.Tensor:
        """This rank's range of the parameters the module computes with (stages 1-3), model dtype."""
        if self.stage == 3:
            return self.part
        P = self.layout.partition_size
        return self.flat[self.rank * P : (self.rank + 1) * P]

    def write(
        self, lp: torch.Tensor, what: str, *, staging: torch.Tensor | None = None, non_blocking: bool = False
    ) -> None:
        """``lp`` (this rank's model-dtype master range, whole at stage 0) becomes the parameters (R13 step 5):
        copied at stage 0, all-gathered at stages 1/2 (through ``staging``, a device buffer, when given), stored
        as the partition at stage 3. A buffer that already is the destination is not copied."""
        if self.stage == 0:
            if lp is not self.flat:
                self.flat.copy_(lp, non_blocking=non_blocking)
        elif self.stage in (1, 2):
            source = lp.to(self.device) if staging is None else staging.copy_(lp, non_blocking=non_blocking)
            self._comm.all_gather_into(self.flat, source, what)
        elif lp is not self.part:
            self.part.copy_(lp, non_blocking=non_blocking)


def _present(buffer: torch.Tensor | None, name: str, where: str) -> torch.Tensor:
    """``buffer``, which exists only at some stages; asking for it elsewhere is a programming error, named."""
    if buffer is None:
        raise RuntimeError(f"LiveWeights.{name} exists at {where} only")
    return buffer

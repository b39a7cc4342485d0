"""The host memory one ZeroEngine owns: offloaded masters, optimizer state, accumulators, cast and parameter buffers.

Every such buffer is allocated here and remembered, so that the engine's ``destroy()`` (and a constructor that
fails half-way) gives all of it back, and ``pinned_buffers()`` can list it.

Pinned buffers are page-locked at their exact size by default (``HOSTOFFLOAD_ZERO_HOST_MEMORY=exact``): from the
native allocator (page-rounded, locked, registered with the accelerator unless
``HOSTOFFLOAD_PIN_REGISTER_DEVICE=0``), whatever ``HOSTOFFLOAD_PIN_BACKEND`` selects for user tensors. Why: the
engine's buffers are few and each the size of a partition, and torch's caching host allocator (the default
backend) rounds every allocation up to the next power of two -- up to twice the host memory, which is what
decides the largest model a box trains (docs/zero.md, "Host memory"). The price is that the buffers count against
the process's locked-memory limit (``ulimit -l``); where it is too low the engine raises
``PinnedMemoryLockError`` naming it, with every buffer it had allocated released.
``HOSTOFFLOAD_ZERO_HOST_MEMORY=pin_backend`` takes the buffers from the pinning API's backend instead.
"""

from __future__ import annotations

import resource

import torch

from optimized.pinning import native_backend, pin_empty, unpin
from reference.contract import envvars
from reference.contract.accelerators import get_accelerator
from reference.contract.errors import PinnedMemoryLockError

__all__ = ["HostBuffers"]


def _locked_bytes() -> str:
    """This process's locked memory as the kernel counts it (``VmLck``), for the lock error."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmLck:"):
                    return f"{int(line.split()[1]) * 1024} bytes"
    except (OSError, ValueError):
        pass
    return "an unknown number of bytes"


class HostBuffers:
    """Allocates one engine's host buffers and frees them together."""

    def __init__(self) -> None:
        self._pinned: list[torch.Tensor] = []

    def empty(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """An uninitialised 1-D host buffer, pinned when ``pinned`` (then owned until :meth:`release`)."""
        if not pinned:
            return torch.empty(numel, dtype=dtype)
        t = self.pinned_untracked(numel, dtype)
        self._pinned.append(t)
        return t

    def pinned_untracked(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned buffer from the same source as :meth:`empty`, which the caller unpins itself (the ``nvme``
        state while it is in memory, allocated and freed every step)."""
        if envvars.zero_host_memory() == "pin_backend":
            return pin_empty(numel, dtype=dtype)
        return self._exact(numel, dtype)

    def _exact(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        envvars.check_pinning_environment()  # the native tuning variables apply; refuse bad values now
        try:
            return native_backend.empty((numel,), dtype, get_accelerator(), envvars.pin_register_device())
        except PinnedMemoryLockError as exc:
            held = sum(t.untyped_storage().nbytes() for t in self._pinned)
            asked = numel * torch.empty((), dtype=dtype).element_size()
            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes ({soft // 1024} KiB)"
            raise PinnedMemoryLockError(
                f"ZeroEngine: cannot page-lock a host buffer of {asked} bytes (this engine already holds {held} "
                f"locked bytes, the process {_locked_bytes()}; the locked-memory limit RLIMIT_MEMLOCK is "
                f"{limit}). The engine pins its offloaded "
                f"state at its exact size: raise the limit with `ulimit -l` (e.g. `ulimit -l unlimited`, the "
                f"memlock entry in /etc/security/limits.conf, or the container's --ulimit memlock), or set "
                f"{envvars.ZERO_HOST_MEMORY_ENV}=pin_backend to take the buffers from "
                f"{envvars.PIN_BACKEND_ENV}'s allocator (torch: rounded up to a power of two). Cause: {exc}"
            ) from exc

    @property
    def pinned(self) -> tuple[torch.Tensor, ...]:
        """The pinned buffers held now."""
        return tuple(self._pinned)

    def release(self) -> None:
        """Unpin every buffer allocated here (never raises on a buffer already gone)."""
        pinned, self._pinned = self._pinned, []
        for t in pinned:
            unpin(t)

"""Run in a child process: build a ZeRO engine with offloaded state under a small RLIMIT_MEMLOCK, without
CAP_IPC_LOCK, and report what happened (the engine-host-memory test reads the JSON line this prints).

Its own process because dropping a capability and lowering a resource limit cannot be undone. World size 1 on a
gloo group over an in-process store. Usage: ``python -m conformance.probes.engine_memlock <accumulation module>
<limit bytes>``.
"""

from __future__ import annotations

import gc
import importlib
import json
import sys

import torch
import torch.distributed as dist

from conformance.probes.memlock import _status, drop_ipc_lock
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_scenario import ModelSpec

#: Fits under the limit the test sets (a few pages per buffer): proves engines can lock memory here at all.
SMALL = ModelSpec()
#: About 100 KiB per fp32 partition-sized buffer: the master and the first Adam moment fit under 256 KiB, the
#: second does not, so the failure comes after the engine has locked some buffers.
LARGE = ModelSpec(in_features=120, hidden=200)


def main() -> None:
    module, limit = sys.argv[1], int(sys.argv[2])
    engine_class = importlib.import_module(module).ZeroEngine
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", dtype="bf16")
    dropped = drop_ipc_lock()
    import resource

    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    base = _status("VmLck")
    small = engine_class(SMALL.build(0), cfg)
    small_locked_kib = _status("VmLck") - base
    small.destroy()
    del small
    gc.collect()
    before = _status("VmLck")
    error = None
    try:
        engine_class(LARGE.build(0), cfg)
    except BaseException as exc:  # report whatever happened; the parent decides
        error = {"type": type(exc).__name__, "is_memory_error": isinstance(exc, MemoryError), "message": str(exc)}
    after = _status("VmLck")  # no gc.collect(): the failed constructor must have released everything itself
    dist.destroy_process_group()
    print(json.dumps({"dropped_cap": dropped, "small_locked_kib": small_locked_kib, "error": error,
                      "before_kib": before, "after_kib": after, "torch": torch.__version__}))


if __name__ == "__main__":
    main()

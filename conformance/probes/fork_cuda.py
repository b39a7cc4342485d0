"""Run in a fresh process on a CUDA machine: ask ``is_pinned`` about registry misses, fork, ask again in the child.

Used by ``test_is_pinned_miss_in_a_forked_child_is_torchs_answer`` (conformance/suite/test_pinning_cuda.py), which
holds the assertion; this probe only observes. Why it exists: an implementation may answer a registry miss by
asking CUDA itself (the optimized one asks the driver from C++, without torch). A forked child inherits that
decision and the resolved entry points, but not a usable CUDA: the driver and the runtime belong to the parent. What
the child must answer is what torch answers there, value or exception, because the contract defines a miss as
torch's own ``Tensor.is_pinned``. It runs in its own interpreter because it forks a process that initialised CUDA,
which the pytest process must not do.

The parent asks about every case first, so that whatever an implementation caches on the first miss (a decision,
resolved entry points) is in place at the fork. Cases: memory torch pinned, pageable memory registered with
``cudaHostRegister`` behind hostoffload's back, plain pageable memory, each asked twice in each process. One JSON
line on stdout: for each case the parent's and the child's outcome of torch's ``is_pinned`` and of the
implementation's, each ``["value", bool]`` or ``["raises", exception type name]``.

Usage: ``python -m conformance.probes.fork_cuda <pinning module>``.
"""

from __future__ import annotations

import importlib
import json
import sys

from conformance.probes.fork import run_child


def outcome(ask) -> list:
    try:
        return ["value", bool(ask())]
    except Exception as exc:  # the outcome is the exception's type; the test compares it with torch's
        return ["raises", type(exc).__name__]


def main() -> None:
    api = importlib.import_module(sys.argv[1])
    import torch

    torch.set_num_threads(1)  # torch's intra-op pool is not fork-safe (see conformance/probes/fork.py)
    torch.cuda.init()
    torch.empty(1, device="cuda")  # a primary context, as in any training process
    cudart = torch.cuda.cudart()
    foreign = torch.empty(1 << 16, dtype=torch.uint8)
    if int(cudart.cudaHostRegister(foreign.data_ptr(), foreign.nbytes, 0)) != 0:
        raise RuntimeError("cudaHostRegister of the foreign buffer failed")
    try:
        cases = {
            "torch-pinned": torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True),
            "registered behind hostoffload's back": foreign,
            "pageable": torch.empty(1 << 16, dtype=torch.uint8),
        }

        def ask_all() -> dict:
            return {what: {"torch": outcome(t.is_pinned), "impl": outcome(lambda t=t: api.is_pinned(t))}
                    for what, t in cases.items()}

        parent = ask_all()
        ask_all()  # twice: the second miss may take a cached path that the first one set up
        # Twice in the child too: its first miss may go another way (a cached decision of the parent's generation
        # no longer applies) than the ones after it.
        child = run_child(lambda: {"cases": ask_all(), "again": ask_all()})
    finally:
        cudart.cudaHostUnregister(foreign.data_ptr())
    print(json.dumps({"parent": parent, "child": child}))


if __name__ == "__main__":
    main()

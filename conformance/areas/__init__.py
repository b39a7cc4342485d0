"""Per-area helpers of the suite: hypothesis strategies, assertions with precise messages, oracles the suite
states for itself (the LR schedules, a kernel's claim), and the state machines and runners an area's tests share.

Each module serves one area (its name says which: ``accumulation_*``, ``io_*``, ``offload_*``; ``strategies``,
``stateful`` and ``cost_growth`` the pinning and range areas; ``assertions`` all of them).
"""

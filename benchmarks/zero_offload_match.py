"""The memory-matched arms of ``bench_zero_offload.py`` (issue 40, issue 49): which peak GPU memory an arm is
matched to, the ``gpu_memory_budget`` that leaves it, and which arms must run first to measure those peaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_configs import DEFAULT_NUMERICS
from zero_offload_arms import MATCH_BASE_ARM, MATCHED

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    pass


def memory_match(rows: list[dict], model: str, gas: int, args) -> dict:
    """The matched arm's budget at (model, gas): ``gpu_memory_budget`` counts only the device side of the split
    (16 bytes per element on the GPU, docs/accumulation.md R28), so matching DeepSpeed's peak GPU memory means a
    budget of what that peak leaves above our peak with everything on the host (share 0), both measured on this
    shape in this run (DeepSpeed's peak may be given instead: ``--match-memory-gib``). Setting the budget to
    DeepSpeed's whole peak would put that much *beside* the share-0 arm's own memory, about twice DeepSpeed's
    (that reading is ``--arms ours-s2-offload-split --gpu-memory-budget-gib PEAK``).
    Returns the row fields: ``match_budget_gib`` (None, with ``match_error``, when a peak is missing); a target at
    or below the base gives a budget of 0 ("auto" then keeps everything on the host)."""

    def peak(arm: str) -> float | None:
        for r in rows:
            if (r["arm"], r["model"], r.get("gas")) == (arm, model, gas) and r.get("peak_gpu_gib") is not None:
                return r["peak_gpu_gib"]
        return None

    measured = {a: peak(a) for a in DEFAULT_NUMERICS if peak(a) is not None}
    target_arm = min(measured, key=measured.get) if measured else None
    matched = args.match_memory_gib if args.match_memory_gib is not None else measured.get(target_arm)
    # issue 40's memory target is "<= 1.1x DeepSpeed's peak": --match-memory-factor 1.1 measures at that bound
    target = None if matched is None else matched * args.match_memory_factor
    base = peak(MATCH_BASE_ARM)
    info = {"match_target_gib": target, "match_target_from": "--match-memory-gib" if args.match_memory_gib
            is not None else f"{target_arm} (the smallest peak of {', '.join(DEFAULT_NUMERICS)} measured)",
            "match_factor": args.match_memory_factor, "match_base_gib": base, "match_budget_gib": None}
    if target is None or base is None:
        missing = MATCH_BASE_ARM if base is None else " or ".join(DEFAULT_NUMERICS)
        info["match_error"] = (f"no peak GPU memory from {missing} at {model}, gas {gas} (not run, failed or on "
                               f"the cpu) to match" + ("" if base is None else "; give --match-memory-gib"))
        return info
    info["match_budget_gib"] = max(0.0, target - base)
    return info


def with_match_prerequisites(arms: list[str], args) -> list[str]:
    """``arms`` in run order: the arms the matched arms read (:func:`memory_match`) moved or added before the
    first of them."""
    matched = [a for a in arms if a.endswith(MATCHED)]
    if not matched:
        return arms
    needs = [MATCH_BASE_ARM] + (list(DEFAULT_NUMERICS) if args.match_memory_gib is None else [])
    added = [a for a in needs if a not in arms]
    if added:
        print(f"  {', '.join(matched)} need(s) {', '.join(added)} measured first: added", flush=True)
    rest = [a for a in arms if a not in needs]
    i = rest.index(matched[0])
    before = [a for a in arms if a in needs] + added
    return rest[:i] + before + rest[i:]

"""Pinning benchmarks: fresh pinned allocation, ``is_pinned`` latency, and H2D/D2H bandwidth per arm.

Three groups, each measured side by side in one process (the issue's targets compare arms of one run):

- ``alloc``: a fresh pinned buffer of 64 MiB / 1 GiB / 4 GiB. Arms: ``torch`` (``torch.empty(...,
  pin_memory=True)``, torch's host cache emptied before every round so each round really allocates),
  ``reference`` (reference native backend), ``optimized`` (optimized native backend, its default: registration
  overlapped with population) and ``optimized_sequential`` (the same with ``HOSTOFFLOAD_PIN_REGISTER_OVERLAP=0``),
  all registering with the
  device when there is one. The buffer is freed outside the timed region; the optimized arm also records where
  its time went (map / lock / populate / register / registry) in ``extra_info``.
- ``is_pinned``: latency of one ``is_pinned`` call on a native pinned tensor while 1, 1k, 100k or 1M ranges are
  live in that implementation's registry (the extra ranges are synthetic, at non-canonical addresses no mapping can
  have). Arms: ``reference``, ``optimized``, and ``torch`` (``torch.Tensor.is_pinned`` on a torch-pinned tensor,
  or on a pageable one where torch cannot pin). The ``is_pinned_miss`` group times the same arms on a pageable
  tensor (the answer is False; a copy decision mostly asks about pageable tensors). As a script it then times,
  per range count, the optimized hit, the optimized miss and torch's miss in alternating order within each round
  (``is_pinned_paired`` in the JSON: issue 19's ``miss - hit`` and ``miss / torch`` as per-round differences, which
  a noisy host cannot skew the way it skews rows timed apart).
- ``bandwidth`` (CUDA only, marked ``gpu``): H2D and D2H copies of 4 MiB .. 1 GiB with ``non_blocking=True`` on a
  side stream, timed with CUDA events around each copy after warm-up; ``extra_info`` holds the median event time
  and GB/s. Arms: ``torch_pinned``, ``pageable``, ``optimized_unregistered`` (locked only) and
  ``optimized_registered``.

Run with pytest-benchmark (``tox -e bench``; ``pytest benchmarks/bench_pinning.py --benchmark-only
--benchmark-json out.json``), or without it: ``python benchmarks/bench_pinning.py --out out.json`` writes the same
JSON layout (``benchmarks[*].group/name/params/stats/extra_info``), which ``benchmarks/plot_pinning.py`` reads.
``--quick`` shrinks sizes and counts for a smoke run on a laptop or CI machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

try:
    import pytest
except ImportError:  # script mode on a machine without pytest: same skips, no pytest entry points

    class _Skip(Exception):
        pass

    class _PytestShim:
        class skip:
            Exception = _Skip

            def __new__(cls, reason: str) -> None:
                raise _Skip(reason)

        class mark:
            gpu = staticmethod(lambda f: f)

            @staticmethod
            def parametrize(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
                return lambda f: f

        @staticmethod
        def fixture(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
            return lambda f: f

    pytest = _PytestShim()  # type: ignore[assignment]

MiB = 1 << 20
GiB = 1 << 30
ALLOC_SIZES = (64 * MiB, 1 * GiB, 4 * GiB)
RANGE_COUNTS = (1, 1_000, 100_000, 1_000_000)
BANDWIDTH_SIZES = (4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
# optimized_sequential: optimized with HOSTOFFLOAD_PIN_REGISTER_OVERLAP=0 (population, then registration).
ALLOC_ARMS = ("torch", "reference", "optimized", "optimized_sequential")
# Synthetic ranges live above the canonical user address space: no real allocation can collide with them.
SYNTHETIC_BASE = 0x7000_0000_0000_0000
SYNTHETIC_STRIDE = 8192
SYNTHETIC_OWNER = 0


def cuda_ok() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def native_backend(register: bool = True) -> Iterator[None]:
    """Select the native pinning backend (and registration) through the environment, as a user would."""
    keys = ("HOSTOFFLOAD_PIN_BACKEND", "HOSTOFFLOAD_PIN_REGISTER_DEVICE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ["HOSTOFFLOAD_PIN_BACKEND"] = "native"
    os.environ["HOSTOFFLOAD_PIN_REGISTER_DEVICE"] = "1" if register else "0"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def empty_torch_host_cache() -> bool:
    """Release torch's cached pinned blocks so the next torch allocation is fresh. False if torch cannot."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    fn()
    return True


# -- runners: pytest-benchmark or a plain loop with the same statistics ---------------------------------------------
class LoopRunner:
    """Stand-in for pytest-benchmark's ``pedantic`` when running as a script; collects results for the JSON."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def run(
        self,
        group: str,
        name: str,
        params: dict[str, Any],
        target: Callable[[], Any],
        setup: Callable[[], None] | None,
        rounds: int,
        iterations: int,
        warmup_rounds: int,
        extra: dict[str, Any],
    ) -> None:
        times = []
        for i in range(warmup_rounds + rounds):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            for _ in range(iterations):
                target()
            dt = (time.perf_counter() - t0) / iterations
            if i >= warmup_rounds:
                times.append(dt)
        if setup is not None:
            setup()
        stats = {
            "min": min(times),
            "max": max(times),
            "mean": statistics.fmean(times),
            "median": statistics.median(times),
            "stddev": statistics.stdev(times) if len(times) > 1 else 0.0,
            "rounds": len(times),
            "iterations": iterations,
        }
        self.results.append(
            {
                "group": group,
                "name": name,
                "fullname": name,
                "params": params,
                "stats": stats,
                "extra_info": extra,
            }
        )
        med = stats["median"]
        shown = f"{med * 1e9:10.1f} ns" if med < 1e-4 else f"{med * 1e3:10.3f} ms"
        print(f"{group:10s} {name:55s} median {shown}  {_fmt_extra(extra)}", flush=True)

    def annotate(self, extra: dict[str, Any]) -> None:
        """Add figures computed after the timed rounds (GB/s from CUDA events, allocation phases)."""
        self.results[-1]["extra_info"].update(extra)
        print(f"{'':10s} -> {_fmt_extra(extra)}", flush=True)


def _fmt_extra(extra: dict[str, Any]) -> str:
    keys = ("gbps", "phases_median_s")
    return " ".join(f"{k}={extra[k]}" for k in keys if k in extra)


class PytestRunner:
    """Adapter: the same measurement through pytest-benchmark's ``benchmark.pedantic``."""

    def __init__(self, benchmark: Any) -> None:
        self.benchmark = benchmark

    def run(self, group, name, params, target, setup, rounds, iterations, warmup_rounds, extra) -> None:
        self.benchmark.group = group
        self.benchmark.extra_info.update(extra)
        self.benchmark.extra_info["params"] = params
        if setup is not None and iterations != 1:
            raise ValueError("pytest-benchmark runs setup once per round; use iterations=1 with a setup")
        self.benchmark.pedantic(
            target,
            setup=setup,
            rounds=rounds,
            iterations=iterations,
            warmup_rounds=warmup_rounds,
        )
        if setup is not None:
            setup()  # free what the last round allocated

    def annotate(self, extra: dict[str, Any]) -> None:
        self.benchmark.extra_info.update(extra)


# -- allocation ---------------------------------------------------------------------------------------------------
def _alloc_fn(arm: str, nbytes: int) -> Callable[[], torch.Tensor]:
    if arm == "torch":
        return lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if arm == "reference":
        import reference.pinning as api
    elif arm in ("optimized", "optimized_sequential"):
        import optimized.pinning as api
    else:
        raise ValueError(f"unknown arm {arm!r}; allowed: torch, reference, optimized, optimized_sequential")
    return lambda: api.pin_empty(nbytes, dtype=torch.uint8)


def bench_alloc(runner: Any, arm: str, nbytes: int, rounds: int) -> None:
    if arm == "torch" and not cuda_ok():
        pytest.skip("torch pins host memory only with a device backend")
    holder: list[torch.Tensor] = []
    phases: list[dict[str, float]] = []
    cache_emptied = [True]

    def setup() -> None:
        if holder and arm.startswith("optimized"):
            from optimized import _native

            t = holder[0]
            alloc = _native.allocation_of(t.data_ptr(), 0)
            if alloc is not None:
                phases.append(dict(alloc.phase_seconds))
        holder.clear()
        gc.collect()
        if arm == "torch":
            cache_emptied[0] = empty_torch_host_cache() and cache_emptied[0]
        if cuda_ok():
            torch.cuda.synchronize()

    fn = _alloc_fn(arm, nbytes)

    def target() -> None:
        holder.append(fn())

    extra: dict[str, Any] = {"nbytes": nbytes, "arm": arm}
    overlap_env = "HOSTOFFLOAD_PIN_REGISTER_OVERLAP"
    old_overlap = os.environ.get(overlap_env)
    os.environ[overlap_env] = "0" if arm == "optimized_sequential" else "1"
    try:
        with native_backend(register=True):
            runner.run(
                "alloc",
                f"alloc[{arm}-{nbytes // MiB}MiB]",
                {"arm": arm, "nbytes": nbytes},
                target,
                setup,
                rounds,
                1,
                1,
                extra,
            )
    finally:
        if old_overlap is None:
            os.environ.pop(overlap_env, None)
        else:
            os.environ[overlap_env] = old_overlap
    if arm == "torch":
        extra["torch_host_cache_emptied"] = cache_emptied[0]
    if phases:
        keys = phases[0].keys()
        extra["phases_median_s"] = {k: round(statistics.median(p[k] for p in phases), 6) for k in keys}
    runner.annotate(extra)


#: What the ``is_pinned`` rows ask about: a native pinned tensor, a pageable one, a device one (CUDA only).
IS_PINNED_KINDS = ("hit", "miss", "device")


# -- is_pinned latency --------------------------------------------------------------------------------------------
class SyntheticRanges:
    """Keeps ``count - 1`` synthetic ranges registered in a registry (grows and shrinks incrementally)."""

    def __init__(self, registry: Any, bulk: bool) -> None:
        self.registry = registry
        self.bulk = bulk
        self.n = 0

    def _start(self, i: int) -> int:
        return SYNTHETIC_BASE + i * SYNTHETIC_STRIDE

    def ensure(self, n: int) -> None:
        if n > self.n:
            new = [(self._start(i), 4096, SYNTHETIC_OWNER) for i in range(self.n, n)]
            if self.bulk:
                self.registry.add_many(new)
            else:
                for s, b, o in new:
                    self.registry.add(s, b, o)
        elif n < self.n:
            starts = [self._start(i) for i in range(self.n - 1, n - 1, -1)]  # from the end: cheap for lists
            if self.bulk:
                self.registry.remove_many(starts)
            else:
                for s in starts:
                    self.registry.remove(s)
        self.n = n


_synthetic: dict[str, SyntheticRanges] = {}


def synthetic_for(arm: str) -> SyntheticRanges | None:
    if arm == "torch":
        return None
    if arm not in _synthetic:
        if arm == "reference":
            from reference.ranges import global_registry

            _synthetic[arm] = SyntheticRanges(global_registry(), bulk=False)
        else:
            from optimized.ranges import global_registry

            _synthetic[arm] = SyntheticRanges(global_registry(), bulk=True)
    return _synthetic[arm]


def release_synthetic() -> None:
    for s in _synthetic.values():
        s.ensure(0)


def bench_is_pinned(runner: Any, arm: str, ranges: int, quick: bool, kind: str = "hit") -> None:
    """One ``is_pinned`` call while ``ranges`` ranges are live. ``kind="hit"``: on a native pinned tensor (torch
    arm: a torch-pinned one); ``kind="miss"``: on a pageable tensor, the common case of a copy decision (every
    arm answers False, the implementations after their registry lookup and torch-pinning query)."""
    if kind not in IS_PINNED_KINDS:
        raise ValueError(f"kind must be one of {IS_PINNED_KINDS}, got {kind!r}")
    if kind == "device" and not cuda_ok():
        pytest.skip("is_pinned on a device tensor needs a CUDA device")
    synthetic = synthetic_for(arm)
    if synthetic is not None:
        synthetic.ensure(ranges - 1)
    with native_backend(register=True):
        if kind == "miss":
            t = torch.empty(1024, dtype=torch.uint8)
            expected = False
        elif kind == "device":
            t = torch.empty(1024, dtype=torch.uint8, device="cuda")
            expected = False
        elif arm == "torch":
            t = torch.empty(1024, dtype=torch.uint8, pin_memory=cuda_ok())
            expected = cuda_ok()
        else:
            t = __import__(f"{arm}.pinning", fromlist=["pin_empty"]).pin_empty(1024, dtype=torch.uint8)
            expected = True
        if arm == "torch":
            fn = t.is_pinned
        else:
            is_pinned = __import__(f"{arm}.pinning", fromlist=["is_pinned"]).is_pinned

            def fn() -> bool:
                return is_pinned(t)

    assert fn() is expected, f"{arm}: is_pinned returned {fn()}, expected {expected}"
    iterations = 2_000 if quick else 20_000
    extra = {"arm": arm, "live_ranges": ranges, "result": expected, "kind": kind}
    # Hit rows keep their historical names (plot_pinning.py, earlier JSON); miss and device rows say so.
    group = "is_pinned" if kind == "hit" else f"is_pinned_{kind}"
    name = f"{group}[{arm}-{ranges}]"
    runner.run(
        group,
        name,
        {"arm": arm, "ranges": ranges, "kind": kind},
        fn,
        None,
        5 if quick else 20,
        iterations,
        1,
        extra,
    )


def bench_is_pinned_paired(ranges: int, quick: bool) -> dict[str, Any]:
    """Issue 19's two miss targets as paired figures: the optimized hit, the optimized miss and torch's own
    ``is_pinned`` on the same pageable tensor, timed in alternating order within every round, so that a noisy
    host (the H200 leases of runs L and M moved whole rows by 2x between rows timed a second apart) slows all
    three alike. Reported: each one's median, and the median over rounds of ``miss - hit`` and ``miss / torch``
    (with the quartiles), which is what the targets compare. Script mode only (not a pytest-benchmark row).

    A fourth arm, ``optimized_miss_no_query``, is the same miss with ``HOSTOFFLOAD_ACCELERATOR=cpu`` (an
    accelerator without torch pinning, so nothing asks CUDA): it splits ``miss - hit`` into what the library adds
    (``no_query - hit``) and what the accelerator's pointer query costs where it is asked, between Python calls
    (``miss - no_query``), which can exceed its cost in a tight C loop (benchmarks/probe_pointer_query.cpp).
    The variable is set around that arm's loop only; the first call after each change re-reads the environment
    and is part of the 10,000."""
    synthetic = synthetic_for("optimized")
    if synthetic is not None:
        synthetic.ensure(ranges - 1)
    from optimized.pinning import is_pinned, pin_empty, unpin

    with native_backend(register=True):
        hit_t = pin_empty(1024, dtype=torch.uint8)
    miss_t = torch.empty(1024, dtype=torch.uint8)
    fns: dict[str, Callable[[], bool]] = {
        "optimized_hit": lambda: is_pinned(hit_t),
        "optimized_miss": lambda: is_pinned(miss_t),
        "optimized_miss_no_query": lambda: is_pinned(miss_t),
        "torch_miss": miss_t.is_pinned,  # bound method: no wrapper, as in the is_pinned_miss rows
    }
    variable = "HOSTOFFLOAD_ACCELERATOR"
    saved = os.environ.get(variable)

    @contextlib.contextmanager
    def arm_environment(name: str) -> Iterator[None]:
        if name != "optimized_miss_no_query":
            yield
            return
        os.environ[variable] = "cpu"
        try:
            yield
        finally:
            if saved is None:
                del os.environ[variable]
            else:
                os.environ[variable] = saved

    for name, fn in fns.items():
        expected = name == "optimized_hit"
        with arm_environment(name):
            answer = fn()
        assert answer is expected, f"{name}: is_pinned returned {answer}, expected {expected}"
    rounds, iterations = (7, 2_000) if quick else (41, 10_000)
    per: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 1):  # round 0 warms up
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            fn = fns[name]
            with arm_environment(name):
                t0 = time.perf_counter()
                for _ in range(iterations):
                    fn()
                elapsed = time.perf_counter() - t0
            if r > 0:
                per[name].append(elapsed / iterations * 1e9)
    unpin(hit_t)

    def paired(a: str, b: str, op: Callable[[float, float], float]) -> list[float]:
        return [op(x, y) for x, y in zip(per[a], per[b], strict=True)]

    def quartiles(xs: list[float], digits: int = 1) -> list[float]:
        q = statistics.quantiles(xs, n=4)
        return [round(q[0], digits), round(q[2], digits)]

    diffs = paired("optimized_miss", "optimized_hit", lambda m, h: m - h)
    ratios = paired("optimized_miss", "torch_miss", lambda m, t: m / t)
    ours = paired("optimized_miss_no_query", "optimized_hit", lambda m, h: m - h)
    query = paired("optimized_miss", "optimized_miss_no_query", lambda m, n: m - n)
    row = {
        "live_ranges": ranges,
        "median_ns": {name: round(statistics.median(xs), 1) for name, xs in per.items()},
        "miss_minus_hit_ns": round(statistics.median(diffs), 1),
        "miss_minus_hit_ns_quartiles": quartiles(diffs),
        "miss_over_torch_miss": round(statistics.median(ratios), 3),
        "miss_over_torch_miss_quartiles": quartiles(ratios, 3),
        "no_query_minus_hit_ns": round(statistics.median(ours), 1),
        "no_query_minus_hit_ns_quartiles": quartiles(ours),
        "miss_minus_no_query_ns": round(statistics.median(query), 1),
        "miss_minus_no_query_ns_quartiles": quartiles(query),
        "rounds": rounds,
        "iterations": iterations,
    }
    print(
        f"is_pinned_paired[{ranges}]: hit {row['median_ns']['optimized_hit']} ns, miss "
        f"{row['median_ns']['optimized_miss']} ns, torch miss {row['median_ns']['torch_miss']} ns; miss - hit "
        f"{row['miss_minus_hit_ns']} ns (quartiles {row['miss_minus_hit_ns_quartiles']}), miss / torch "
        f"{row['miss_over_torch_miss']} (quartiles {row['miss_over_torch_miss_quartiles']}); of miss - hit, the "
        f"library {row['no_query_minus_hit_ns']} ns (quartiles {row['no_query_minus_hit_ns_quartiles']}) and the "
        f"accelerator's query {row['miss_minus_no_query_ns']} ns (quartiles {row['miss_minus_no_query_ns_quartiles']})",
        flush=True,
    )
    return row


# -- bandwidth ----------------------------------------------------------------------------------------------------
def _host_buffer(arm: str, nbytes: int) -> torch.Tensor:
    if arm == "torch_pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if arm == "pageable":
        return torch.empty(nbytes, dtype=torch.uint8)
    import optimized.pinning as api

    with native_backend(register=arm == "optimized_registered"):
        return api.pin_empty(nbytes, dtype=torch.uint8)


def bench_bandwidth(runner: Any, arm: str, direction: str, nbytes: int, quick: bool) -> None:
    if not cuda_ok():
        pytest.skip("bandwidth needs a CUDA device")
    host = _host_buffer(arm, nbytes)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def target() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            end.record(stream)
        end.synchronize()
        events.append((start, end))

    rounds = 5 if quick else (10 if nbytes >= 256 * MiB else 30)
    warmup = 3
    extra: dict[str, Any] = {"arm": arm, "direction": direction, "nbytes": nbytes}
    runner.run(
        "bandwidth",
        f"bandwidth[{direction}-{arm}-{nbytes // MiB}MiB]",
        {"arm": arm, "direction": direction, "nbytes": nbytes},
        target,
        None,
        rounds,
        1,
        warmup,
        extra,
    )
    times = [s.elapsed_time(e) / 1e3 for s, e in events[warmup:]] or [
        s.elapsed_time(e) / 1e3 for s, e in events
    ]
    med = statistics.median(times)
    extra["event_median_s"] = med
    extra["gbps"] = round(nbytes / med / 1e9, 2)
    runner.annotate(extra)


# -- allocation phases (where does the time go) ----------------------------------------------------------------------
def bench_phases(out: list[dict[str, Any]], nbytes: int) -> None:
    """Optimized allocation of ``nbytes`` under each huge-page mode and thread count: per-phase seconds."""
    from optimized import _native

    register = cuda_ok()
    if register:
        import optimized.pinning.native_backend  # noqa: F401  (loads the runtime torch uses)

        _ = torch.cuda.current_device()
    cpu = os.cpu_count() or 1
    grid = [("off", t) for t in sorted({1, min(16, cpu)})]
    grid += [("auto", t) for t in sorted({1, 4, 8, min(16, cpu), cpu})]
    grid += [("hugetlb", min(16, cpu))]
    grid = [(h, t, False) for h, t in grid]
    if register:
        grid += [("auto", t, True) for t in sorted({2, 4, 8, min(16, cpu)})]
    for huge, threads, overlap in grid:
        t0 = time.perf_counter()
        a = _native.allocate(
            nbytes, huge, threads, register and _native.cuda_runtime_available(), 0, False, overlap
        )
        total = time.perf_counter() - t0
        row = {
            "nbytes": nbytes,
            "huge_pages": huge,
            "threads": threads,
            "overlap_register": overlap,
            "page_kind": a.page_kind,
            "registered": a.registered,
            "total_s": round(total, 6),
            **{k: round(v, 6) for k, v in a.phase_seconds.items()},
        }
        t1 = time.perf_counter()
        del a
        row["free_s"] = round(time.perf_counter() - t1, 6)
        out.append(row)
        print("phases", json.dumps(row), flush=True)


# -- pytest-benchmark entry points ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _cleanup_synthetic() -> Iterator[None]:
    yield
    release_synthetic()


@pytest.mark.parametrize("nbytes", ALLOC_SIZES, ids=lambda n: f"{n // MiB}MiB")
@pytest.mark.parametrize("arm", ALLOC_ARMS)
def test_alloc(benchmark, arm: str, nbytes: int) -> None:
    bench_alloc(PytestRunner(benchmark), arm, nbytes, rounds=3 if nbytes >= GiB else 5)


@pytest.mark.parametrize("kind", IS_PINNED_KINDS)
@pytest.mark.parametrize("arm", ("torch", "reference", "optimized"))
@pytest.mark.parametrize("ranges", RANGE_COUNTS)
def test_is_pinned(benchmark, ranges: int, arm: str, kind: str) -> None:
    bench_is_pinned(PytestRunner(benchmark), arm, ranges, quick=False, kind=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", BANDWIDTH_SIZES, ids=lambda n: f"{n // MiB}MiB")
@pytest.mark.parametrize("direction", ("h2d", "d2h"))
@pytest.mark.parametrize(
    "arm", ("torch_pinned", "pageable", "optimized_unregistered", "optimized_registered")
)
def test_bandwidth(benchmark, arm: str, direction: str, nbytes: int) -> None:
    bench_bandwidth(PytestRunner(benchmark), arm, direction, nbytes, quick=False)


# -- script mode ------------------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda_ok() else None,
    }
    with contextlib.suppress(ImportError):
        from optimized import _native

        info["cuda_runtime"] = _native.cuda_runtime_describe()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(OSError):
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            info["thp"] = fh.read().strip()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output (pytest-benchmark layout)")
    parser.add_argument(
        "--only",
        default="alloc,is_pinned,bandwidth,phases",
        help="comma-separated groups: alloc, is_pinned, is_pinned_paired (also run by is_pinned), bandwidth, phases",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and counts (smoke run)")
    parser.add_argument(
        "--alloc-rounds",
        type=int,
        default=None,
        help="rounds per alloc row (default: 3, 2 above 1 GiB or with --quick); the JSON keeps every round, so "
        "the spread (min/median/max) of a fresh 4 GiB allocation is in stats",
    )
    parser.add_argument("--alloc-sizes", default=None, help="comma-separated MiB sizes for the alloc group, e.g. 4096")
    args = parser.parse_args(argv)
    groups = {g.strip() for g in args.only.split(",") if g.strip()}
    unknown = groups - {"alloc", "is_pinned", "is_pinned_paired", "bandwidth", "phases"}
    if unknown:
        parser.error(
            f"--only: unknown groups {sorted(unknown)}; allowed: alloc, is_pinned, is_pinned_paired, bandwidth, phases"
        )
    if cuda_ok():
        # torch.cuda.init() does not create the device's primary context; the first allocation does. Every
        # training process has one. Without it, a miss the driver cannot answer falls to the runtime path, which
        # then hands it to torch (asking the runtime would create a context): run I's 1-range miss row, 1191 ns.
        torch.cuda.init()
        torch.empty(1, device="cuda")
    runner = LoopRunner()
    phases: list[dict[str, Any]] = []
    paired: list[dict[str, Any]] = []
    alloc_sizes = (4 * MiB, 64 * MiB) if args.quick else ALLOC_SIZES
    if args.alloc_sizes:
        alloc_sizes = tuple(int(x) * MiB for x in args.alloc_sizes.split(","))
    if args.alloc_rounds is not None and args.alloc_rounds < 1:
        parser.error(f"--alloc-rounds={args.alloc_rounds}: allowed values: an int >= 1")
    counts = (1, 1_000, 100_000) if args.quick else RANGE_COUNTS
    bw_sizes = (4 * MiB, 16 * MiB) if args.quick else BANDWIDTH_SIZES
    skipped: list[str] = []

    def attempt(fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except pytest.skip.Exception as exc:
            skipped.append(f"{what}: {exc}")

    def dump() -> None:
        doc = {
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "machine_info": machine_info(),
            "benchmarks": runner.results,
            "phases": phases,
            "is_pinned_paired": paired,
            "skipped": skipped,
            "errors": errors,
        }
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)

    errors: list[str] = []

    def group(name: str, fn: Callable[[], None]) -> None:
        """Run one group; a failure is recorded and the next group still runs. JSON is rewritten after each."""
        if name not in groups:
            return
        try:
            fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        dump()

    def run_alloc() -> None:
        for nbytes in alloc_sizes:
            for arm in ALLOC_ARMS:
                rounds = args.alloc_rounds or (2 if args.quick or nbytes > GiB else 3)
                attempt(
                    lambda a=arm, n=nbytes, r=rounds: bench_alloc(runner, a, n, rounds=r),
                    f"alloc {arm} {nbytes}",
                )

    def run_is_pinned() -> None:
        try:
            for count in counts:
                for kind in IS_PINNED_KINDS:
                    for arm in ("torch", "reference", "optimized"):
                        attempt(
                            lambda a=arm, c=count, k=kind: bench_is_pinned(runner, a, c, args.quick, k),
                            f"is_pinned {kind} {arm} {count}",
                        )
                if "is_pinned_paired" not in groups:  # else its own group runs it
                    paired.append(bench_is_pinned_paired(count, args.quick))
        finally:
            release_synthetic()

    def run_is_pinned_paired() -> None:
        try:
            for count in counts:
                paired.append(bench_is_pinned_paired(count, args.quick))
        finally:
            release_synthetic()

    def run_bandwidth() -> None:
        for arm in ("torch_pinned", "pageable", "optimized_unregistered", "optimized_registered"):
            for direction in ("h2d", "d2h"):
                for nbytes in bw_sizes:
                    attempt(
                        lambda a=arm, d=direction, n=nbytes: bench_bandwidth(runner, a, d, n, args.quick),
                        f"bandwidth {arm}",
                    )

    group("alloc", run_alloc)
    group("phases", lambda: bench_phases(phases, 64 * MiB if args.quick else 4 * GiB))
    group("is_pinned", run_is_pinned)
    group("is_pinned_paired", run_is_pinned_paired)
    group("bandwidth", run_bandwidth)
    dump()
    print(
        f"wrote {args.out} ({len(runner.results)} benchmarks, {len(phases)} phase rows, {len(skipped)} skipped, "
        f"{len(errors)} errors)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

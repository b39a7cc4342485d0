"""Swap I/O benchmark: write and read bandwidth (GB/s) of tensors to files, per arm and size.

Arms (``--arms``, comma separated):

- ``optimized_direct`` / ``optimized_bounced``: :class:`optimized.io.SwapHandle` with a tensor pinned by
  ``optimized.pinning`` (native backend: used directly, no bounce copy) / a pageable tensor (staged through the
  handle's pinned bounce pool). ``optimized_device``: a CUDA tensor (bounced), only where CUDA is available.
- ``reference_direct`` / ``reference_bounced``: the blocking reference handle, same tensors.
- ``torch_save``: ``torch.save`` / ``torch.load`` of the tensor.
- ``buffered``: a plain ``open(path, "wb").write`` / ``readinto`` of the tensor's bytes through the page cache.

What is timed: a write is the call until the data is durable (every arm fsyncs the file inside the timed region,
so page-cache arms are not credited with bytes still in memory; ``--no-fsync`` drops that); a read starts cold:
the file's cached pages are dropped first (``posix_fadvise(DONTNEED)`` after an fsync, no root needed), so every
arm reads from the device. Each (arm, size) is measured ``--repeats`` times after one warm-up; the table shows the
median GB/s (1 GB = 1e9 bytes).

Usage (GPU box, on its NVMe)::

    HOSTOFFLOAD_BENCH_IO_JSON=/path/io.json python benchmarks/bench_io.py --dir /nvme/tmp --sizes 64M,256M,1G,4G

On a CPU machine keep it small: ``python benchmarks/bench_io.py --sizes 16M,64M --repeats 2``. JSON goes to
``--out`` or ``$HOSTOFFLOAD_BENCH_IO_JSON`` (date, hardware, filesystem, exact command, handle knobs, every
sample). Through pytest-benchmark (``tox -e bench``): ``test_io_bandwidth``, small sizes
(``HOSTOFFLOAD_BENCH_IO_MIB``, default 64).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

ALL_ARMS = (
    "optimized_direct",
    "optimized_bounced",
    "optimized_device",
    "reference_direct",
    "reference_bounced",
    "torch_save",
    "buffered",
)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Make the next read of ``path`` come from the device: flush, then drop its clean cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Arm:
    """One way of moving a tensor to a file and back. ``write``/``read`` do one timed operation."""

    def __init__(self, name: str, nbytes: int, args: argparse.Namespace) -> None:
        self.name = name
        self.nbytes = nbytes
        self.args = args
        self.handle = None
        kind = name.rsplit("_", 1)[-1]
        if name.startswith(("optimized", "reference")):
            impl = name.split("_", 1)[0]
            io = __import__(f"{impl}.io", fromlist=["SwapHandle"])
            pinning = __import__(f"{impl}.pinning", fromlist=["pin_empty"])
            knobs = {
                "queue_depth": args.queue_depth,
                "block_size": args.block_size,
                "num_threads": args.threads,
                "use_o_direct": not args.no_o_direct,
            }
            self.handle = io.SwapHandle(**knobs)
            if kind == "direct":
                os.environ["HOSTOFFLOAD_PIN_BACKEND"] = "native"
                self.src = pinning.pin_empty(nbytes, dtype=torch.uint8)
                self.dst = pinning.pin_empty(nbytes, dtype=torch.uint8)
            elif kind == "device":
                self.src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            else:
                self.src = torch.empty(nbytes, dtype=torch.uint8)
                self.dst = torch.empty(nbytes, dtype=torch.uint8)
        else:
            self.src = torch.empty(nbytes, dtype=torch.uint8)
            self.dst = torch.empty(nbytes, dtype=torch.uint8)
        # Incompressible, non-zero contents (a zero page can be special-cased by some filesystems).
        g = torch.Generator().manual_seed(nbytes)
        chunk = torch.randint(0, 256, (min(nbytes, 1 << 24),), dtype=torch.uint8, generator=g)
        for a in range(0, nbytes, chunk.numel()):
            n = min(chunk.numel(), nbytes - a)
            self.src[a : a + n].copy_(chunk[:n])

    def write(self, path: str) -> None:
        if self.handle is not None:
            req = self.handle.write(self.src, path)
            req.wait()
            if not self.args.no_fsync:
                _fsync_path(path)
            self.last = req
        elif self.name == "torch_save":
            with open(path, "wb") as f:
                torch.save(self.src, f)
                if not self.args.no_fsync:
                    f.flush()
                    os.fsync(f.fileno())
        else:
            with open(path, "wb", buffering=0) as f:
                view = _byte_view(self.src)
                while view:
                    view = view[f.write(view) :]
                if not self.args.no_fsync:
                    os.fsync(f.fileno())

    def read(self, path: str) -> None:
        if self.handle is not None:
            self.last = self.handle.read(self.dst, path)
            self.last.wait()
        elif self.name == "torch_save":
            self.dst = torch.load(path)
        else:
            with open(path, "rb", buffering=0) as f:
                view = _byte_view(self.dst)
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(path)
                    view = view[n:]
        if self.name.endswith("device"):
            torch.cuda.synchronize()

    def check(self) -> None:
        if not torch.equal(self.src.cpu(), self.dst.cpu()):
            raise AssertionError(f"{self.name}: data read back differs from data written")

    def stats(self) -> dict[str, Any]:
        if self.handle is None:
            return {}
        return self.handle.stats()._asdict()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.src = self.dst = None


def measure(arm: Arm, directory: str, repeats: int) -> dict[str, Any]:
    path = os.path.join(directory, f"{arm.name}.bin")
    out: dict[str, Any] = {"arm": arm.name, "bytes": arm.nbytes}
    for op, fn in (("write", arm.write), ("read", arm.read)):
        times = []
        for i in range(repeats + 1):  # the first run is a warm-up
            if op == "write" and os.path.exists(path):
                os.unlink(path)  # every write creates its file, as a swap-out of fresh state does
            if op == "read":
                drop_cache(path)
            t0 = time.perf_counter()
            fn(path)
            dt = time.perf_counter() - t0
            if i:
                times.append(dt)
        out[f"{op}_seconds"] = times
        out[f"{op}_gbps"] = arm.nbytes / statistics.median(times) / 1e9
    arm.check()
    out["handle_stats"] = arm.stats()
    if hasattr(arm, "last"):
        out["direct"] = arm.last.direct
        out["o_direct"] = arm.last.o_direct
    os.unlink(path)
    return out


def filesystem_of(directory: str) -> str:
    try:
        res = subprocess.run(["df", "-T", directory], capture_output=True, text=True, check=True)
        line = res.stdout.strip().splitlines()[-1].split()
        return f"{line[1]} on {line[0]}"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ALL_ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; allowed: {', '.join(ALL_ARMS)}")
    if "optimized_device" in arms and not torch.cuda.is_available():
        arms.remove("optimized_device")
        log("optimized_device skipped: CUDA is not available")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    directory = tempfile.mkdtemp(prefix="hostoffload-bench-io-", dir=args.dir)
    results = []
    try:
        log(f"directory {directory} ({filesystem_of(directory)}); block_size {human(args.block_size)}, "
            f"queue_depth {args.queue_depth}, threads {args.threads}, O_DIRECT {not args.no_o_direct}, "
            f"fsync in writes {not args.no_fsync}, repeats {args.repeats}")
        log(f"{'arm':<20} {'size':>9} {'write GB/s':>11} {'read GB/s':>10}  direct  O_DIRECT")
        for size in sizes:
            for name in arms:
                arm = Arm(name, size, args)
                try:
                    r = measure(arm, directory, args.repeats)
                finally:
                    arm.close()
                results.append(r)
                log(f"{name:<20} {human(size):>9} {r['write_gbps']:>11.2f} {r['read_gbps']:>10.2f}  "
                    f"{r.get('direct', '-')!s:<6}  {r.get('o_direct', '-')}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "benchmark": "bench_io",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "hardware": hardware(),
        "filesystem": filesystem_of(args.dir or tempfile.gettempdir()),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M,256M,1G,4G", help="comma separated, e.g. 64M,1G (default %(default)s)")
    parser.add_argument("--arms", default=",".join(ALL_ARMS))
    parser.add_argument("--dir", default=os.environ.get("HOSTOFFLOAD_BENCH_IO_DIR"),
                        help="directory on the disk to measure (default $HOSTOFFLOAD_BENCH_IO_DIR, else $TMPDIR)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=parse_size, default=parse_size("8M"))
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--no-o-direct", action="store_true", help="handles do not try O_DIRECT")
    parser.add_argument("--no-fsync", action="store_true", help="do not include fsync in write times")
    parser.add_argument("--out", default=os.environ.get("HOSTOFFLOAD_BENCH_IO_JSON"),
                        help="write the JSON report here (default $HOSTOFFLOAD_BENCH_IO_JSON)")
    args = parser.parse_args(argv)
    report = run(args)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.out}")


# -- pytest-benchmark entry points (``tox -e bench``) --------------------------------------------------------------
try:
    import pytest
except ImportError:  # script mode on a machine without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.mark.parametrize("op", ("write", "read"))
    @pytest.mark.parametrize("arm_name", [a for a in ALL_ARMS if a != "optimized_device"])
    def test_io_bandwidth(benchmark, tmp_path, arm_name, op):
        nbytes = int(os.environ.get("HOSTOFFLOAD_BENCH_IO_MIB", "64")) << 20
        args = argparse.Namespace(queue_depth=16, block_size=8 << 20, threads=8, no_o_direct=False, no_fsync=False)
        arm = Arm(arm_name, nbytes, args)
        path = str(tmp_path / "bench.bin")
        try:
            arm.write(path)

            def setup():
                if op == "read":
                    drop_cache(path)
                else:
                    os.unlink(path)

            benchmark.pedantic(getattr(arm, op), args=(path,), setup=setup, rounds=3, iterations=1)
            if op == "read":
                arm.check()
            benchmark.extra_info["bytes"] = nbytes
            benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9
        finally:
            arm.close()


if __name__ == "__main__":
    main()

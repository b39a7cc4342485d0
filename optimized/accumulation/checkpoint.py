"""The on-disk format of ZeroEngine checkpoints: one file per rank, a manifest, and an atomic commit.

Why not ``torch.distributed.checkpoint`` (DCP): DCP reshards tensors whose *global* shape is fixed and whose
shards are DTensor placements or ShardedTensor chunks. A ZeRO partition is neither: it is a contiguous range of
the R8 flat buffer, whose padded length depends on the world size, and it cuts parameters at arbitrary element
offsets (a range may hold the tail of one matrix and the head of the next). Expressing that in DCP would need
one ShardedTensor (deprecated in torch) per flattened parameter with hand-made chunk metadata, and the pinned /
NVMe-swapped buffers would still be copied out first. DCP also commits by writing ``.metadata`` last into the
final directory, so a crash leaves a directory that *looks* like a checkpoint being written. Here the pieces
are recorded in parameter coordinates instead -- ``(name, first element, length)`` -- which is independent of
world size and stage, so any rank of any later run can assemble its own range from the files that overlap it
(resharding is interval intersection), and a save is staged in a hidden directory that becomes the tag's
directory with a single ``rename`` once every rank's file and the manifest are on disk.

Layout of ``<dir>/<tag>/``: ``rank<r>.pt`` (``torch.save`` of this rank's tensors and state, loadable with
``weights_only=True``) and ``manifest.json`` (format marker, world size, parameter names and shapes, which
pieces each rank file holds, counters). ``<dir>/latest`` names the newest tag (DeepSpeed's convention).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from reference.contract.errors import CheckpointError, ConfigurationError

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "VERSION",
    "assemble",
    "commit",
    "read_manifest",
    "read_rank_file",
    "resolve_tag",
    "staging_directory",
    "write_rank_file",
]

FORMAT = "hostoffload.zero_checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"

#: A piece of a flat range in parameter coordinates: (parameter name, first element in the parameter, element
#: count). The same piece list describes where it sits in any rank's buffer through ``local_start``.
Piece = tuple[str, int, int]


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or os.sep in tag or tag.startswith("."):
        raise ConfigurationError(
            f"tag={tag!r} must be a non-empty str without path separators that does not start with '.'"
        )
    return tag


def staging_directory(directory: str, tag: str) -> str:
    """Where a save of ``tag`` is written before it is committed (hidden: never mistaken for a checkpoint)."""
    return os.path.join(directory, f".{_check_tag(tag)}.partial")


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: str, write: Any) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_rank_file(staging: str, rank: int, payload: dict[str, Any]) -> int:
    """Write ``rank<r>.pt`` into the staging directory; returns its size in bytes."""
    path = os.path.join(staging, f"rank{rank}.pt")
    _write_atomically(path, lambda f: torch.save(payload, f))
    return os.path.getsize(path)


def commit(directory: str, tag: str, manifest: dict[str, Any], *, save_latest: bool) -> str:
    """Rank 0, after every rank wrote its file: write the manifest, then make the staging directory the tag's
    directory in one rename (replacing an older checkpoint of the same tag), then update ``latest``."""
    staging = staging_directory(directory, tag)
    final = os.path.join(directory, tag)
    _write_atomically(os.path.join(staging, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_path(staging, directory=True)
    old = None
    if os.path.lexists(final):
        old = os.path.join(directory, f".{tag}.old")
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_path(directory, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        _write_atomically(os.path.join(directory, LATEST), lambda f: f.write(tag.encode()))
    return final


def resolve_tag(directory: str, tag: str | None) -> str:
    """``tag``, or the one ``<dir>/latest`` names."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigurationError(f"load_dir={directory!r} must be a str or PathLike naming a directory")
    if tag is not None:
        return _check_tag(tag)
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(
            f"no checkpoint to load in {os.fspath(directory)!r}: tag=None reads the file 'latest', which does not "
            f"exist (tags there: {_tags(directory)}); allowed: pass tag=, or a directory save_checkpoint() wrote"
        )
    with open(latest, encoding="utf-8") as f:
        return _check_tag(f.read().strip())


def _tags(directory: str) -> list[str]:
    try:
        return sorted(
            e for e in os.listdir(directory) if os.path.isfile(os.path.join(directory, e, MANIFEST))
        )
    except OSError:
        return []


def read_manifest(directory: str, tag: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint's path and manifest; :class:`CheckpointError` when it is missing, partial or foreign."""
    path = os.path.join(os.fspath(directory), tag)
    where = f"checkpoint {tag!r} in {os.fspath(directory)!r}"
    if not os.path.isdir(path):
        partial = os.path.isdir(staging_directory(os.fspath(directory), tag))
        raise CheckpointError(
            f"{where} does not exist"
            + (" (only an unfinished save of it was found: the save did not complete)" if partial else "")
            + f"; tags there: {_tags(os.fspath(directory))}"
        )
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(
            f"{where} has no {MANIFEST}: it is partial (a save that did not complete) or not a hostoffload "
            f"ZeroEngine checkpoint"
        )
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({exc}); the checkpoint is damaged") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{where} is not a hostoffload ZeroEngine checkpoint (format {manifest.get('format')!r} in "
            f"{MANIFEST}, expected {FORMAT!r})" if isinstance(manifest, dict) else f"{where}: malformed {MANIFEST}"
        )
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{where} has format version {manifest.get('version')!r}; this engine reads {VERSION}")
    for r, entry in enumerate(manifest["ranks"]):
        fpath = os.path.join(path, entry["file"])
        if not os.path.isfile(fpath) or os.path.getsize(fpath) != entry["bytes"]:
            raise CheckpointError(
                f"{where} is partial: {entry['file']} (rank {r} of {manifest['world_size']}) is missing or has "
                f"a different size than the manifest records"
            )
    return path, manifest


def read_rank_file(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    fpath = os.path.join(path, entry["file"])
    try:
        return torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {fpath!r} cannot be loaded ({type(exc).__name__}: {exc})") from exc


def pieces_of_range(segments: Sequence[Any], lo: int, hi: int) -> list[tuple[str, int, int, int]]:
    """The parameter pieces of flat range ``[lo, hi)``: (name, first element in the parameter, offset in the
    range, length), in flat order, padding excluded."""
    out = []
    for s in segments:
        a, b = max(lo, s.offset), min(hi, s.end)
        if a < b:
            out.append((s.name, a - s.offset, a - lo, b - a))
    return out


def assemble(
    needed: Sequence[tuple[str, int, int, int]],
    out: torch.Tensor,
    sources: Sequence[tuple[Sequence[Sequence[Any]], torch.Tensor]],
) -> None:
    """Fill ``out`` (the range ``needed`` describes, padding left as it is) from saved ranges: each source is
    (its pieces as saved: ``[name, first element, offset in the saved range, length]``, the saved tensor).
    Resharding is the intersection of intervals in parameter coordinates."""
    by_name: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for pieces, tensor in sources:
        for name, pstart, local, length in pieces:
            by_name.setdefault(name, []).append((pstart, length, tensor[local : local + length]))
    for name, pstart, local, length in needed:
        covered = 0
        for spstart, slength, data in by_name.get(name, ()):
            a, b = max(pstart, spstart), min(pstart + length, spstart + slength)
            if a < b:
                out[local + a - pstart : local + b - pstart].copy_(data[a - spstart : b - spstart])
                covered += b - a
        if covered != length:
            raise CheckpointError(
                f"checkpoint does not cover elements of parameter {name!r} (found {covered} of {length} needed "
                f"from element {pstart}); it is partial"
            )

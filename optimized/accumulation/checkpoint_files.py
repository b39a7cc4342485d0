"""The durable on-disk format of ZeroEngine checkpoints: what is written, in which order, and what a load verifies.

Layout of ``<dir>/<tag>/``: ``rank<r>.pt`` (``torch.save`` of one rank's tensors and state, loadable with
``weights_only=True``), ``client_state.pt`` (rank 0's ``client_state``: stored once, not in every rank file) and
``manifest.json`` (format marker, world size, parameter names and shapes, which pieces each rank file holds,
counters, and for every rank file and the client_state file its size and the CRC-32 of each 16 MiB block as written;
the manifest carries the CRC-32 of its own canonical text too). ``<dir>/latest`` names the newest tag
(DeepSpeed's convention).

Why each step (docs/zero.md, "Checkpoints: what is guaranteed"):

- A save is staged in the hidden ``.<tag>.partial/``; every file is fsynced, then the staging directory, and
  ``latest.tmp`` is written before anything visible changes, so every step that can run out of space or fail to
  write happens while the previous checkpoint is untouched.
- The commit is renames only: ``<tag>`` -> ``.<tag>.old`` (when the tag exists), ``.<tag>.partial`` -> ``<tag>``,
  ``latest.tmp`` -> ``latest``, each followed by an fsync of ``<dir>``. A rename that fails is undone in reverse
  order, so a save that raises leaves the previous checkpoint and ``latest`` as they were. A process killed
  between the first two renames leaves ``.<tag>.old`` alone: a load of the tag reads it, and the next save puts
  it back first (:func:`prepare`).
- Checksums catch what the unpickler would not: bytes flipped inside tensor data load without complaint, and a
  damaged pickle header makes torch print a page of unrelated advice. A load computes the CRC-32 of every rank
  file it reads before unpickling it.

Why CRC-32 (``zlib.crc32``): it detects every burst of up to 32 flipped bits and any other damage with
probability 1 - 2**-32, which is what storage damage needs (this is not a defence against someone forging a
file); it runs at a few GB/s per core, and the blocks of a write are checksummed on helper threads while the same
bytes are being written, so a save costs about max(write, checksum / threads) instead of their sum
(``benchmarks/bench_checkpoint.py`` measures it).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from reference.contract.accumulation_checkpoint_names import LATEST, LATEST_STAGING, check_tag
from reference.contract.errors import CheckpointError, ConfigurationError

__all__ = [
    "CLIENT_STATE",
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "READABLE_VERSIONS",
    "VERSION",
    "commit",
    "discard",
    "os_error",
    "prepare",
    "read_manifest",
    "read_rank_file",
    "resolve_tag",
    "staging_directory",
    "write_client_state",
    "write_rank_file",
]

FORMAT = "hostoffload.zero_checkpoint"
#: 2: per-file sizes and CRC-32 in the manifest, the manifest's own CRC-32 (version 1 had sizes only).
#: 3: ``client_state`` stored once, in :data:`CLIENT_STATE` (version 2 kept a copy in every rank file).
VERSION = 3
#: The versions a load reads.
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
#: Rank 0's ``client_state``, the one copy (docs/zero.md: stored once; every rank's load returns it).
CLIENT_STATE = "client_state.pt"
_RANK_FILE = re.compile(r"rank(\d+)\.pt")
#: Writes at least this large are checksummed on the helper thread while they are written.
_OVERLAP_BYTES = 1 << 20
#: The file is checksummed in blocks of this size (one CRC-32 each in the manifest), so that the blocks of a
#: large write are checksummed in parallel; 16 MiB keeps the manifest small (64 numbers per GiB).
BLOCK = 16 << 20
#: Helper threads that checksum while the calling thread writes.
_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) - 1))


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def staging_directory(directory: str, tag: str) -> str:
    """Where a save of ``tag`` is written before it is committed (hidden: never mistaken for a checkpoint)."""
    return os.path.join(directory, f".{tag}.partial")


_staging = staging_directory


def _old(directory: str, tag: str) -> str:
    return os.path.join(directory, f".{tag}.old")


def os_error(exc: OSError, what: str, path: str, directory: str, needed: int | None = None) -> CheckpointError:
    """A :class:`CheckpointError` naming the checkpoint directory, the path, the errno and its meaning; for a
    full disk, the bytes this step needed and the bytes free."""
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else type(exc).__name__
    text = f"{what}: {code} ({exc.strerror or exc}) at {path!r} in save_dir={directory!r}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            free = None
        text += f"; this step needs about {needed} bytes" if needed is not None else ""
        text += f", {free} bytes are free there" if free is not None else ""
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        text += "; allowed: a save_dir this process may write"
    error = CheckpointError(text + "; the previous checkpoint of this tag (if any) is unchanged")
    error.__cause__ = exc
    return error


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(staging: str) -> None:
    """Rank 0, after a save failed on any rank: remove its staging directory (nothing of it is kept)."""
    _remove(staging)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.unlink(path)
        except OSError:
            pass


def prepare(directory: str, tag: str) -> str:
    """Rank 0, before any rank writes: create ``directory``; finish what an earlier process left (a commit killed
    between its two renames is rolled back to its previous checkpoint; stale ``.*.partial`` directories and
    ``latest.tmp`` are swept: one job saves into a directory at a time); return a fresh staging directory."""
    try:
        os.makedirs(directory, exist_ok=True)
        for entry in os.listdir(directory):
            path = os.path.join(directory, entry)
            if entry.startswith(".") and entry.endswith(".old"):
                final = os.path.join(directory, entry[1:-4])
                if os.path.lexists(final):
                    _remove(path)
                else:
                    os.rename(path, final)
            elif (entry.startswith(".") and entry.endswith(".partial")) or entry == LATEST_STAGING:
                _remove(path)
        staging = _staging(directory, tag)
        os.makedirs(staging)
    except OSError as exc:
        raise os_error(exc, "save_checkpoint cannot prepare its staging directory", exc.filename or directory,
                       directory) from exc
    return staging


class _ChecksummedFile:
    """The file object ``torch.save`` writes into: counts the bytes and keeps one CRC-32 per block of
    :data:`BLOCK` bytes of the file. The blocks a write covers are checksummed on the helper threads while the
    calling thread writes the same bytes (zlib and the write both release the GIL), so a save costs about
    max(write, checksum / threads) rather than their sum; the call returns only when both are done, so the
    caller's buffer is never read after it."""

    def __init__(self, f: Any, pool: ThreadPoolExecutor) -> None:
        self._f = f
        self._pool = pool
        self.blocks: list[int] = []
        self.size = 0
        #: The OSError of a failed write: torch's writer replaces it with a RuntimeError ("unexpected pos").
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except OSError as exc:
            self.error = exc
            raise

    def _pieces(self, n: int) -> list[tuple[int, int, int]]:
        """(block index, start, end) in the buffer of a write of ``n`` bytes at offset ``self.size``."""
        out, at = [], 0
        while at < n:
            block, used = divmod(self.size + at, BLOCK)
            end = min(n, at + BLOCK - used)
            out.append((block, at, end))
            at = end
        return out

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        pieces = self._pieces(len(view))
        start_crc = [self.blocks[b] if b < len(self.blocks) else 0 for b, _, _ in pieces]
        if len(view) < _OVERLAP_BYTES:
            crcs = [zlib.crc32(view[a:e], c) for (_, a, e), c in zip(pieces, start_crc, strict=True)]
            self._f.write(view)
        else:
            pending = [self._pool.submit(zlib.crc32, view[a:e], c)
                       for (_, a, e), c in zip(pieces, start_crc, strict=True)]
            try:
                self._f.write(view)
            finally:
                crcs = [p.result() for p in pending]
        for (block, _, _), crc in zip(pieces, crcs, strict=True):
            if block < len(self.blocks):
                self.blocks[block] = crc
            else:
                self.blocks.append(crc)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()


def write_rank_file(staging: str, rank: int, payload: dict[str, Any], directory: str) -> dict[str, Any]:
    """Write ``rank<r>.pt`` into the staging directory, fsynced; return its manifest entry (file, bytes, crc32).
    A failure removes the file and raises a :class:`CheckpointError` naming the path and the cause."""
    return _write_checked(staging, rank_file(rank), payload, directory, f"rank {rank}'s")


def write_client_state(staging: str, client_state: dict[str, Any], directory: str) -> dict[str, Any]:
    """Rank 0: write :data:`CLIENT_STATE` (the one copy of ``client_state``) like a rank file; its entry goes into
    the manifest under ``client_state``."""
    return _write_checked(staging, CLIENT_STATE, {"client_state": client_state}, directory, "the client_state")


def _write_checked(staging: str, name: str, payload: dict[str, Any], directory: str, whose: str) -> dict[str, Any]:
    path = os.path.join(staging, name)
    needed = sum(t.nbytes for t in _tensors(payload))
    out = None
    try:
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="checkpoint-crc") as pool, open(path, "wb") as f:
            out = _ChecksummedFile(f, pool)
            torch.save(payload, out)  # type: ignore[arg-type]  # a duck-typed binary file: write() is what save uses
            f.flush()
            os.fsync(f.fileno())
    except Exception as exc:
        _remove(path)
        cause = exc if isinstance(exc, OSError) else (out.error if out is not None else None)
        if cause is not None:
            what = f"save_checkpoint cannot write {whose} file"
            raise os_error(cause, what, path, directory, needed) from exc
        raise CheckpointError(
            f"save_checkpoint cannot serialise {whose} state into {path!r} ({type(exc).__name__}: {exc})"
        ) from exc
    return {"file": name, "bytes": out.size, "block": BLOCK, "crc32": out.blocks}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _manifest_crc(manifest: dict[str, Any]) -> int:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _write_small(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(directory: str, tag: str, manifest: dict[str, Any], *, save_latest: bool) -> str:
    """Rank 0, after every rank wrote its file: the manifest and ``latest.tmp`` first, then the renames (module
    docstring). Raises :class:`CheckpointError`; whatever it raises for, the previous checkpoint is in place."""
    staging, final, old = _staging(directory, tag), os.path.join(directory, tag), _old(directory, tag)
    latest, latest_tmp = os.path.join(directory, LATEST), os.path.join(directory, LATEST_STAGING)
    manifest = {**manifest, "manifest_crc32": 0}
    manifest["manifest_crc32"] = _manifest_crc(manifest)
    done: list[str] = []
    try:
        _write_small(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1).encode())
        _fsync_directory(staging)
        if save_latest:
            _write_small(latest_tmp, tag.encode())
        if os.path.lexists(final):
            os.rename(final, old)
            done.append("old")
        os.rename(staging, final)
        done.append("final")
        _fsync_directory(directory)
        if save_latest:
            os.replace(latest_tmp, latest)
            done.append("latest")
            _fsync_directory(directory)
    except OSError as exc:
        if "latest" not in done:
            _undo(done, staging, final, old)
            _remove(latest_tmp)
            _remove(staging)
        raise os_error(exc, "save_checkpoint cannot commit", exc.filename or directory, directory) from exc
    _remove(old)
    return final


def _undo(done: list[str], staging: str, final: str, old: str) -> None:
    """Reverse the commit's renames (best effort: a failure here leaves ``.<tag>.old``, which the next load reads
    and the next save restores)."""
    try:
        if "final" in done:
            os.rename(final, staging)
        if "old" in done:
            os.rename(old, final)
    except OSError:
        pass


def resolve_tag(directory: str, tag: str | None) -> str:
    """``tag``, or the one ``<dir>/latest`` names. A ``latest`` file that names no tag a save could have written
    (empty, ``../x``, undecodable) is the checkpoint directory's fault, not the caller's: a
    :class:`CheckpointError` naming the file. Only a line ending is taken off its text (a person's ``echo tag >
    latest``); a tag a save accepts never ends with one, so nothing a save wrote is changed by it."""
    if tag is not None:
        return check_tag(tag)
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(
            f"no checkpoint to load in {directory!r}: tag=None reads the file 'latest', which does not exist (tags "
            f"there: {_tags(directory)}); allowed: pass tag=, or a directory save_checkpoint() wrote"
        )
    try:
        with open(latest, "rb") as f:
            name = f.read().decode("utf-8").rstrip("\r\n")
        return check_tag(name)
    except (OSError, UnicodeError, ConfigurationError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"the file {latest!r}, which load_checkpoint reads for tag=None, names no checkpoint ({reason}); "
            f"allowed: a 'latest' file naming one of the tags there ({_tags(directory)}), or pass tag="
        ) from exc


def _tags(directory: str) -> list[str]:
    try:
        return sorted(e for e in os.listdir(directory) if os.path.isfile(os.path.join(directory, e, MANIFEST)))
    except OSError:
        return []


def read_manifest(directory: str, tag: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint's path and its verified manifest, cross-checked against the rank files present (names,
    count, sizes); :class:`CheckpointError` naming the damage when it is missing, partial, edited or foreign."""
    path = os.path.join(directory, tag)
    where = f"checkpoint {tag!r} in {directory!r}"
    if not os.path.isdir(path) and os.path.isfile(os.path.join(_old(directory, tag), MANIFEST)):
        path = _old(directory, tag)  # a commit killed between its renames: the previous checkpoint is here
    if not os.path.isdir(path):
        partial = os.path.isdir(_staging(directory, tag))
        raise CheckpointError(
            f"{where} does not exist"
            + (" (only an unfinished save of it was found: the save did not complete)" if partial else "")
            + f"; tags there: {_tags(directory)}"
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
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{where} is not a hostoffload ZeroEngine checkpoint ({MANIFEST} format {found!r}, "
                              f"expected {FORMAT!r})")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{where} has format version {manifest.get('version')!r}; this engine reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    if manifest.get("manifest_crc32") != _manifest_crc(manifest):
        raise CheckpointError(f"{where}: {MANIFEST} is damaged or was edited after save_checkpoint wrote it (its "
                              f"checksum does not match its contents); the checkpoint cannot be trusted")
    _cross_check(where, path, manifest)
    return path, manifest


def _cross_check(where: str, path: str, manifest: dict[str, Any]) -> None:
    ranks, world = manifest["ranks"], manifest["world_size"]
    expected = [rank_file(r) for r in range(len(ranks))]
    if world != len(ranks) or [e["file"] for e in ranks] != expected:
        raise CheckpointError(f"{where}: {MANIFEST} says world_size={world!r} but lists rank files "
                              f"{[e.get('file') for e in ranks]}; the manifest is damaged")
    present = sorted((e for e in os.listdir(path) if _RANK_FILE.fullmatch(e)), key=lambda e: int(e[4:-3]))
    if present != expected:
        raise CheckpointError(f"{where} is partial or mixed: the manifest lists {expected} (world_size={world}), "
                              f"the directory holds {present}")
    for r, entry in enumerate(ranks):
        size = os.path.getsize(os.path.join(path, entry["file"]))
        if size != entry["bytes"]:
            raise CheckpointError(f"{where} is partial: {entry['file']} (rank {r} of {world}) has {size} bytes, the "
                                  f"manifest records {entry['bytes']} (a truncated or replaced file)")
    client = manifest.get("client_state")
    if client is not None:  # version 3: the one copy of client_state is a file of its own
        cpath = os.path.join(path, client["file"])
        if not os.path.isfile(cpath):
            raise CheckpointError(f"{where} is partial: {client['file']}, which the manifest lists (the saved "
                                  f"client_state), is missing")
        if os.path.getsize(cpath) != client["bytes"]:
            raise CheckpointError(f"{where} is partial: {client['file']} has {os.path.getsize(cpath)} bytes, the "
                                  f"manifest records {client['bytes']} (a truncated or replaced file)")


def _block_crcs(path: str, block: int) -> list[int]:
    out = []
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while n := f.readinto(buf):
            out.append(zlib.crc32(view[:n]))
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def read_client_state(path: str, manifest: dict[str, Any], own: dict[str, Any]) -> Any:
    """The saved ``client_state``: the one copy (version 3), or the loading rank's own (version 2)."""
    entry = manifest.get("client_state")
    return own["client_state"] if entry is None else read_rank_file(path, entry)["client_state"]


def read_rank_file(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One rank file (or the client_state file), its CRC-32 verified against the manifest before it is
    unpickled. Damage is reported as the bytes the failing checksum covers, clipped to the file (a small file
    is one block shorter than :data:`BLOCK`: its nominal range would point past the end)."""
    fpath = os.path.join(path, entry["file"])
    what = "rank file" if _RANK_FILE.fullmatch(entry["file"]) else "file"
    try:
        crcs = _block_crcs(fpath, entry["block"])
        size = os.path.getsize(fpath)
    except OSError as exc:
        raise CheckpointError(f"{what} {fpath!r} cannot be read ({exc})") from exc
    bad = [i for i, (a, b) in enumerate(zip(crcs, entry["crc32"], strict=False)) if a != b]
    if bad or len(crcs) != len(entry["crc32"]):
        block = entry["block"]
        where = f"bytes {bad[0] * block} to {min((bad[0] + 1) * block, size)}" if bad else "its length"
        others = f" (and {len(bad) - 1} more block(s) of {block} bytes)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{what} {fpath!r} is damaged or was not written by save_checkpoint: the CRC-32 of {where}{others} "
            f"differs from the one the manifest records"
        )
    try:
        return torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        first = _ANSI.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{what} {fpath!r} was not written by this version's save_checkpoint ({type(exc).__name__}: {first})"
        ) from exc

"""ZeroEngine checkpoints: the on-disk format (one file per rank, a manifest, an atomic commit) and what an engine
writes into it and reads back (``save``, ``load``, ``install_state``: the engine's ``save_checkpoint`` /
``load_checkpoint`` / ``load_state_dict`` delegate here).

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

The files, the order they are written in and what a load verifies (checksums, the manifest against the rank
files) are :mod:`.checkpoint_files`; this module decides what an engine puts into them and takes out. A
``client_state`` is checked before anything touches the disk (:func:`check_client_state`), so a save never
writes a checkpoint that a ``weights_only`` load cannot read back.

The consolidated weights (the engine's ``state_dict`` / ``load_state_dict``: a plain module's state, no files) are
here too (:func:`module_state_dict`, :func:`load_module_state`): loading them is a checkpoint install without the
optimizer state.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from optimized.accumulation.checkpoint_files import (
    FORMAT,
    VERSION,
    check_tag,
    commit,
    discard,
    prepare,
    read_client_state,
    read_manifest,
    read_rank_file,
    resolve_tag,
    staging_directory,
    write_client_state,
    write_rank_file,
)
from optimized.accumulation.checkpoint_view import CheckpointView
from reference.contract.accumulation_step import state_buffer_names
from reference.contract.errors import (
    CheckpointError,
    ConfigurationError,
    HostOffloadError,
    UnsupportedOperationError,
)

__all__ = [
    "agree",
    "assemble",
    "check_client_state",
    "frozen_range",
    "install_state",
    "load",
    "load_module_state",
    "master_range",
    "module_state_dict",
    "pieces_of_range",
    "save",
]

#: Leaf values a client_state may hold: each round-trips through ``torch.load(weights_only=True)`` on every
#: supported torch (checked by the suite's client-state property). Containers: list, tuple, dict (and
#: OrderedDict) of these, with keys of the same kinds.
_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, nn.Parameter)
_CONTAINERS = (list, tuple, dict, OrderedDict)


def check_client_state(client_state: Any) -> dict[str, Any]:
    """``client_state`` as the dict a save stores, or a :class:`ConfigurationError` naming the first value a
    ``weights_only`` load could not read back (``client_state['best']`` and its type) -- raised before anything
    touches the disk. numpy values, ``argparse.Namespace``, lambdas and open files are refused with a hint."""
    if client_state is None:
        return {}
    if not isinstance(client_state, Mapping):
        raise ConfigurationError(
            f"client_state={type(client_state).__name__} must be a mapping (a dict of plain values) or None"
        )
    _check_value(dict(client_state), "client_state", depth=0)
    return dict(client_state)


def _check_value(value: Any, where: str, depth: int) -> None:
    kind = type(value)
    if kind in _LEAVES or kind in _TENSORS:
        return
    if depth > 64:
        raise ConfigurationError(f"{where} is nested more than 64 containers deep; allowed: plain data")
    if kind in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict):
                _check_value(k, f"{where} key {k!r}", depth + 1)
            _check_value(v, f"{where}[{k!r}]", depth + 1)
        return
    hint = ""
    if kind.__module__ == "numpy":
        hint = " (a numpy value: convert it with float(x), int(x), x.tolist() or torch.from_numpy(x))"
    elif kind.__name__ == "Namespace":
        hint = " (an argparse.Namespace: store vars(args))"
    raise ConfigurationError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}{hint}, which a checkpoint cannot store so that it loads "
        f"back with weights_only=True; allowed: tensors, None, bool, int, float, str, bytes, torch.dtype, "
        f"torch.device, and lists, tuples and dicts of these. Nothing was written"
    )


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


# ---- what a ZeroEngine writes and reads (the engine's save_checkpoint/load_checkpoint delegate here) -----------
# The engine side is written against the engine's :class:`.CheckpointView` (``engine`` below: layouts, parameters,
# the update path, the schedule -- what the engine hands out, not its private attributes); the format functions
# above know nothing of it.


def agree(comm: Any, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed, and all raise the first failure (so no rank goes on into a
    collective its peers will never join)."""
    errors = comm.all_gather_objects(None if error is None else (type(error).__name__, str(error)), what)
    if error is not None:
        raise error
    for r, e in enumerate(errors):
        if e is not None:
            cls = ConfigurationError if e[0] == "ConfigurationError" else CheckpointError
            raise cls(f"{what} failed on rank {r}: {e[0]}: {e[1]}")


def master_range(engine: CheckpointView) -> tuple[int, int]:
    """The flat range of the engine's fp32 master: the whole buffer at stage 0, this rank's partition above."""
    P = engine.layout.partition_size
    return (0, engine.layout.total) if engine.stage == 0 else (engine.rank * P, (engine.rank + 1) * P)


def frozen_range(engine: CheckpointView) -> tuple[int, int]:
    """The flat range of frozen parameters this rank holds: all of them below stage 3, its partition at 3."""
    if engine.stage != 3:
        return (0, engine.frozen_layout.total)
    size = engine.frozen_layout.partition_size
    return (engine.rank * size, (engine.rank + 1) * size)


def save(
    engine: CheckpointView, save_dir: str | os.PathLike, tag: str | None, client_state: Any, save_latest: bool
) -> str:
    """:meth:`ZeroEngine.save_checkpoint`: refuse a save inside backward() / no_sync() or one that would drop an
    accumulated gradient, check the arguments (client_state included) and agree on them, prepare
    the staging directory on rank 0, write every rank's file, commit on rank 0 (:mod:`.checkpoint_files`). Any
    rank's failure is every rank's :class:`CheckpointError` or :class:`ConfigurationError`."""
    if engine.in_backward or engine.in_no_sync:
        raise UnsupportedOperationError(
            "save_checkpoint() inside backward() or no_sync(); allowed: call it between steps"
        )
    if engine.grads_pending:
        raise UnsupportedOperationError(
            "save_checkpoint() after backward() without a boundary step(): the accumulated gradient is not "
            "part of a checkpoint and would be lost; allowed: save right after a boundary step(), or "
            "zero_grad() first to drop it on purpose"
        )
    comm = engine.comm
    if not isinstance(save_dir, (str, os.PathLike)):
        raise ConfigurationError(f"save_dir={save_dir!r} must be a str or PathLike naming a directory")
    if type(save_latest) is not bool:
        raise ConfigurationError(f"save_latest={save_latest!r} must be a bool; allowed values: True, False")
    directory = os.fspath(save_dir)
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    error: HostOffloadError | None = None
    try:
        check_tag(tag)
        client = check_client_state(client_state)
    except ConfigurationError as exc:
        error = exc
    tags = comm.all_gather_objects((directory, tag), "checkpoint tag agreement")
    if error is None and any(t != tags[0] for t in tags):
        error = ConfigurationError(
            f"save_checkpoint: ranks passed different (save_dir, tag): {tags}; allowed: the same on every rank"
        )
    agree(comm, error, "save_checkpoint")  # every rank's arguments are good before rank 0 touches the disk
    staging = staging_directory(directory, tag)
    if engine.rank == 0:
        try:
            staging = prepare(directory, tag)
        except CheckpointError as exc:
            error = exc
    agree(comm, error, "save_checkpoint (staging)")
    entry = client_entry = None
    try:
        entry, opt_state, state = _write_engine_rank_file(engine, staging, directory)
        if engine.rank == 0:  # client_state is stored once (docs/zero.md), rank 0's as DeepSpeed keeps it
            client_entry = write_client_state(staging, client, directory)
    except (CheckpointError, ConfigurationError) as exc:  # reported to every rank, then re-raised here
        error = exc
    try:
        agree(comm, error, "save_checkpoint (rank files)")
    except BaseException:
        if engine.rank == 0:
            discard(staging)
        raise
    entries = comm.all_gather_objects(entry, "checkpoint manifest gather")
    manifest = _manifest(engine, tag, opt_state.step, sorted(state), entries)
    manifest["client_state"] = client_entry  # rank 0 commits the manifest: its entry is the one that counts
    if engine.rank == 0:
        try:
            commit(directory, tag, manifest, save_latest=save_latest)
        except CheckpointError as exc:
            error = exc
    agree(comm, error, "save_checkpoint (commit)")
    return os.path.join(directory, tag)


def _manifest(
    engine: CheckpointView, tag: str, optimizer_step: int, state_names: list[str], entries: list
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "world_size": engine.world_size,
        "zero_stage": engine.stage,
        "model_dtype": engine.config.dtype,
        "optimizer_type": engine.config.optimizer.type,
        # R29: the precision the rank files' moments are stored in (a load converts: to bf16 rounded to nearest
        # even, to fp32 exactly; a manifest without the key is fp32)
        "state_precision": engine.config.state_precision,
        "optimizer_step": optimizer_step,
        "delayed_parameter_update": engine.path.lags_parameters,
        "state_buffers": state_names,
        "parameters": {s.name: list(s.shape) for s in engine.layout.segments},
        "frozen_parameters": {s.name: list(s.shape) for s in engine.frozen_layout.segments},
        "counters": engine.schedule.counters(),
        "ranks": entries,
    }


def _write_engine_rank_file(engine: CheckpointView, staging: str, directory: str) -> tuple:
    """This rank's part of a save: its tensors and state into ``staging/rank<r>.pt``."""
    opt_state = engine.optimizer_state()  # with nvme: read back from its files
    lo, hi = master_range(engine)
    if engine.stage == 0:
        P = engine.layout.partition_size
        lo, hi = engine.rank * P, (engine.rank + 1) * P
        master, state = engine.path.master[lo:hi], {k: v[lo:hi] for k, v in opt_state.buffers.items()}
    else:
        master, state = engine.path.master, opt_state.buffers
    size = engine.frozen_layout.partition_size
    flo, fhi = engine.rank * size, (engine.rank + 1) * size
    if engine.stage == 3:
        frozen = engine.weights.frozen_part.to("cpu", copy=True)
    else:
        frozen = torch.zeros(fhi - flo, dtype=engine.config.model_dtype)
        for name, pstart, local, length in pieces_of_range(engine.frozen_layout.segments, flo, fhi):
            frozen[local : local + length].copy_(engine.params[name].detach().reshape(-1)[pstart : pstart + length])
    rng = {"cpu": torch.get_rng_state()}
    if engine.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.device)
    scheduler = engine.lr_scheduler
    payload = {
        # R27: the weights a delayed run computes with are not the master's cast; resuming needs them
        "applied": engine.path.live_weights_to_save(),
        "master": master.to("cpu", copy=True),
        "state": {k: v.to("cpu", copy=True) for k, v in state.items()},
        "frozen": frozen,
        "buffers": {k: v.detach().to("cpu", copy=True) for k, v in engine.module.named_buffers()},
        "rng": rng,
        "optimizer": engine.optimizer.state_dict()["param_groups"],
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
    }
    entry = write_rank_file(staging, engine.rank, payload, directory)
    entry["trainable"] = pieces_of_range(engine.layout.segments, lo, hi)
    entry["frozen"] = pieces_of_range(engine.frozen_layout.segments, flo, fhi)
    return entry, opt_state, state


def load(
    engine: CheckpointView, load_dir: str | os.PathLike, tag: str | None, *, load_optimizer_states: bool,
    load_lr_scheduler_states: bool, load_module_only: bool,
) -> tuple[str, dict[str, Any]]:
    """:meth:`ZeroEngine.load_checkpoint`: read and check everything, agree, then install (arguments checked)."""
    if engine.in_backward or engine.in_no_sync:
        raise UnsupportedOperationError("load_checkpoint() inside backward() or no_sync(); allowed: between steps")
    for name, v in (("load_optimizer_states", load_optimizer_states),
                    ("load_lr_scheduler_states", load_lr_scheduler_states), ("load_module_only", load_module_only)):
        if type(v) is not bool:
            raise ConfigurationError(f"{name}={v!r} must be a bool; allowed values: True, False")
    if not isinstance(load_dir, (str, os.PathLike)):
        raise ConfigurationError(f"load_dir={load_dir!r} must be a str or PathLike naming a directory")
    error = None
    loaded = None
    try:
        loaded = _read_for_engine(engine, os.fspath(load_dir), tag, load_optimizer_states and not load_module_only)
    except (CheckpointError, ConfigurationError) as exc:
        error = exc
    except (OSError, KeyError, TypeError, ValueError, IndexError) as exc:  # a damaged manifest or file
        error = CheckpointError(f"checkpoint in {os.fspath(load_dir)!r} (tag {tag!r}) cannot be read: {exc!r}")
        error.__cause__ = exc
    agree(engine.comm, error, "load_checkpoint")
    assert loaded is not None  # agree() raised on every rank if any failed to read
    path, manifest, master, state, frozen, own, applied = loaded
    install_state(engine, master, state, frozen, own["buffers"], applied)
    if not load_module_only:
        engine.schedule.restore_counters(manifest["counters"])
        if load_optimizer_states:
            engine.path.opt_state.step = manifest["optimizer_step"]
        if load_lr_scheduler_states:
            _load_hyperparameters(engine, own)
        if engine.rank < manifest["world_size"]:
            torch.set_rng_state(own["rng"]["cpu"])
            if "cuda" in own["rng"] and engine.device.type == "cuda":
                torch.cuda.set_rng_state(own["rng"]["cuda"], engine.device)
    return path, own["client_state"]


def _load_hyperparameters(engine: CheckpointView, own: dict[str, Any]) -> None:
    """The optimizer's group values and the lr_scheduler state (applied when a scheduler is attached later)."""
    groups = engine.optimizer.state_dict()
    saved_groups = zip(own["optimizer"], groups["param_groups"], strict=True)
    groups["param_groups"] = [{**g, "params": mine["params"]} for g, mine in saved_groups]
    engine.optimizer.load_state_dict(groups)
    if own["lr_scheduler"] is not None:
        engine.lr_schedule.load_state_dict(own["lr_scheduler"])  # now, or when a scheduler is attached


def _check_compatible(
    engine: CheckpointView, where: str, manifest: dict[str, Any], with_state: bool, need_state: list
) -> None:
    """A checkpoint of another model, or optimizer state this engine cannot use, is refused before any read."""
    mine = {s.name: list(s.shape) for s in engine.layout.segments}
    mine_frozen = {s.name: list(s.shape) for s in engine.frozen_layout.segments}
    for what, saved, have in (("trainable", manifest["parameters"], mine),
                              ("frozen", manifest["frozen_parameters"], mine_frozen)):
        if saved != have:
            diff = sorted(k for k in set(saved) | set(have) if saved.get(k) != have.get(k))
            raise CheckpointError(
                f"{where} was saved from another model: its {what} parameters differ from this engine's at "
                f"{diff[:5]} (saved {[saved.get(k) for k in diff[:5]]}, here {[have.get(k) for k in diff[:5]]})"
            )
    if with_state and manifest["optimizer_type"] != engine.config.optimizer.type:
        raise CheckpointError(
            f"{where} holds {manifest['optimizer_type']!r} optimizer state; this engine runs "
            f"{engine.config.optimizer.type!r}; allowed: the same optimizer type, or load_optimizer_states=False"
        )
    if with_state and sorted(manifest["state_buffers"]) != need_state:
        raise CheckpointError(
            f"{where} holds optimizer state {manifest['state_buffers']}; this engine needs {need_state} "
            f"(e.g. SGD momentum on one side only); allowed: load_optimizer_states=False"
        )


def _read_for_engine(engine: CheckpointView, directory: str, tag: str | None, with_state: bool) -> tuple:
    """Everything a load installs, read and assembled into this engine's ranges; nothing of the engine changes."""
    tag = resolve_tag(directory, tag)
    path, manifest = read_manifest(directory, tag)
    # every path keeps exactly the config's optimizer's state buffers (R16), wherever they wait between steps
    need_state = sorted(state_buffer_names(engine.config.optimizer))
    _check_compatible(engine, f"checkpoint {tag!r} in {directory!r}", manifest, with_state, need_state)
    lo, hi = master_range(engine)
    flo, fhi = frozen_range(engine)
    needed = pieces_of_range(engine.layout.segments, lo, hi)
    fneeded = pieces_of_range(engine.frozen_layout.segments, flo, fhi)
    files: dict[int, dict[str, Any]] = {}
    wanted_names = {n for n, *_ in needed}
    fwanted = {n for n, *_ in fneeded}
    own_rank = engine.rank if engine.rank < manifest["world_size"] else 0
    for r, entry in enumerate(manifest["ranks"]):
        if r == own_rank or any(p[0] in wanted_names for p in entry["trainable"]) or any(
            p[0] in fwanted for p in entry["frozen"]
        ):
            files[r] = read_rank_file(path, entry)

    def assembled(key: str, length: int, dtype: torch.dtype, frozen: bool = False, state: str | None = None):
        out = torch.zeros(length, dtype=dtype)
        kind = "frozen" if frozen else "trainable"
        sources = [
            (manifest["ranks"][r][kind], f[key] if state is None else f[key][state]) for r, f in files.items()
        ]
        assemble(fneeded if frozen else needed, out, sources)
        return out

    model_dtype = engine.config.model_dtype
    master = assembled("master", hi - lo, torch.float32)
    # R29: moments of either precision assemble into fp32 (bf16 widens exactly); the path stores them in its own.
    state = {k: assembled("state", hi - lo, torch.float32, state=k) for k in need_state} if with_state else None
    frozen = assembled("frozen", fhi - flo, model_dtype, frozen=True)
    applied = None
    if engine.path.lags_parameters and manifest.get("delayed_parameter_update"):
        # R27: the weights the saved delayed run was computing with (the master's cast was still pending).
        applied = assembled("applied", hi - lo, model_dtype)
    own = {**files[own_rank], "client_state": read_client_state(path, manifest, files[own_rank])}
    return path, manifest, master, state, frozen, own, applied


def install_state(
    engine: CheckpointView,
    master: torch.Tensor,
    opt_buffers: dict[str, torch.Tensor] | None,
    frozen: Any,
    buffers: Any,
    applied: torch.Tensor | None = None,
) -> None:
    """Make ``master`` (this rank's master range) the engine's weights: the model-dtype parameters become its
    cast (R13 step 5: the invariant a boundary leaves), all-gathered at stages 1/2; ``frozen`` is a name -> full
    tensor mapping or this rank's flat frozen range. Gradients accumulated so far are dropped. ``applied`` (R27,
    delayed update only): this rank's range of the parameters to compute with instead of the master's cast (a
    delayed run's checkpoint). Used by a checkpoint load and by ``load_state_dict``."""
    engine.path.install(master, opt_buffers, applied)
    _install_frozen(engine, frozen)
    own = dict(engine.module.named_buffers())
    for k, v in buffers.items():
        own[k].copy_(v)
    engine.gradients_dropped()


def _install_frozen(engine: CheckpointView, frozen: Any) -> None:
    model_dtype = engine.config.model_dtype
    flo, fhi = frozen_range(engine)
    segments = {s.name: s for s in engine.frozen_layout.segments}
    if isinstance(frozen, torch.Tensor):
        if engine.stage == 3:
            engine.weights.frozen_part.copy_(frozen)
        else:
            for n in engine.frozen_names:
                s = segments[n]
                engine.params[n].data.copy_(frozen[s.offset : s.end].view(s.shape))
    else:
        for n, v in frozen.items():
            s = segments[n]
            if engine.stage == 3:
                for _, pstart, local, length in pieces_of_range([s], flo, fhi):
                    src = v.detach().reshape(-1)[pstart : pstart + length]
                    engine.weights.frozen_part[local : local + length].copy_(src)
            else:
                engine.params[n].data.copy_(v.detach().to(model_dtype))


# ---- consolidated weights (the engine's state_dict/load_state_dict delegate here) ---------------------------------


def module_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every parameter taken from ``full`` (full shape, model dtype) and copies of the
    buffers: what a plain ``nn.Module`` loads."""
    return {k: full[k] if k in full else v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def load_module_state(engine: CheckpointView, state_dict: Any, strict: bool) -> None:
    """:meth:`ZeroEngine.load_state_dict`: everything checked first (keys with ``strict``, shapes always), then the
    master range is filled from the full parameters (fp32: exactly) and installed with frozen parameters and
    buffers; optimizer state and counters are kept. No communication."""
    if engine.in_backward:
        raise UnsupportedOperationError("load_state_dict() during backward(); allowed: call it between calls")
    if not isinstance(state_dict, Mapping):
        raise ConfigurationError(f"state_dict={type(state_dict).__name__} must be a mapping name -> tensor")
    buffers = dict(engine.module.named_buffers())
    expected = set(engine.params) | set(buffers)
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise ConfigurationError(
            f"state_dict does not match the module: missing keys {missing}, unexpected keys {unexpected}; "
            f"allowed: the keys of engine.state_dict(), or strict=False"
        )
    shapes = {s.name: s.shape for s in (*engine.layout.segments, *engine.frozen_layout.segments)}
    for k, v in state_dict.items():
        want = shapes.get(k, tuple(buffers[k].shape) if k in buffers else None)
        if want is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(want)):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ConfigurationError(f"state_dict[{k!r}] has shape {got}; the module's is {tuple(want)}")
    master = engine.path.master.clone()
    lo = 0 if engine.stage == 0 else engine.rank * engine.layout.partition_size
    for name, pstart, local, length in pieces_of_range(engine.layout.segments, lo, lo + master.numel()):
        if name in state_dict:
            flat = state_dict[name].detach().reshape(-1).to(torch.float32)
            master[local : local + length].copy_(flat[pstart : pstart + length])
    frozen = {k: state_dict[k] for k in engine.frozen_names if k in state_dict}
    loaded_buffers = {k: v for k, v in state_dict.items() if k in buffers}
    install_state(engine, master, None, frozen, loaded_buffers)

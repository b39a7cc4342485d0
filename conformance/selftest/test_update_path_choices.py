"""hostoffload's streamed update path, assembled from its three choices (issue 51 item 1).

The streamed path is one class (`optimized.accumulation.update_paths.StreamedHostUpdate`) built from a
`StreamedChoices` that one table (`STREAMED_CHOICES`) gives for the config's ``delayed_parameter_update``,
``gpu_share`` and ``host_update_start``. This enumerates every combination of those three settings: each one the
config accepts has a row and builds an engine whose path holds exactly the parts its row names (the release policy,
a device side, a speculative stage) and lags the parameters exactly when R27 is on; each one the config refuses
has no row; and every row is reached. It checks hostoffload's own assembly, not an implementation under judgment
(the suite's engine tests judge what each path computes).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from conformance.harness.rank_pool import RankFailure, get_pool
from optimized.accumulation.update_paths import STREAMED_CHOICES, StreamedHostUpdate, streamed_choices
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("harness")

COMBINATIONS = list(itertools.product((False, True), (0.0, 0.5), ("step", "last_backward")))


def _config(delayed: bool, share: float, start: str) -> dict:
    return {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "dtype": "bf16",
            "delayed_parameter_update": delayed, "gpu_share": share, "host_update_start": start}


def _accepted(combination: tuple) -> AccumulationConfig | None:
    try:
        return AccumulationConfig.from_dict(_config(*combination))
    except ConfigurationError:
        return None


def _parts_of_built_path(group, config: dict) -> dict:
    """Rank function: build a ZeroEngine on the host with ``config`` and say which parts its path holds."""
    from optimized.accumulation import ZeroEngine

    torch.manual_seed(0)
    engine = ZeroEngine(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), config, process_group=group, device="cpu")
    try:
        path = engine._parts.path  # hostoffload's own engine: its live parts (LiveParts)
        return {"path": type(path).__name__, "release": type(path._release).__name__,
                "split": path._split is not None, "speculation": path._speculation is not None,
                "lags": path.lags_parameters}
    finally:
        engine.destroy()


def test_every_accepted_combination_has_a_row_and_every_row_is_reached():
    """The table is the config's domain: no accepted combination without a row, no row for a refused one."""
    reached = set()
    for combination in COMBINATIONS:
        config = _accepted(combination)
        delayed, share, start = combination
        key = (delayed, share != 0.0, start == "last_backward")
        if config is None:
            assert key not in STREAMED_CHOICES, f"{combination} is refused by the config but has a row"
            continue
        assert streamed_choices(config) is STREAMED_CHOICES[key]
        reached.add(key)
    assert reached == set(STREAMED_CHOICES), f"rows no config reaches: {set(STREAMED_CHOICES) - reached}"


@pytest.mark.parametrize("combination", [c for c in COMBINATIONS if _accepted(c) is not None],
                         ids=lambda c: f"delayed={c[0]}-share={c[1]}-start={c[2]}")
def test_each_combination_builds_the_parts_its_row_names(combination):
    """An engine built with the combination has the streamed path with its row's release policy, a device side
    exactly when it splits, a speculative stage exactly when it speculates, and lags the parameters exactly with
    R27 (what a checkpoint records)."""
    delayed, share, start = combination
    # what each setting means, written here independently of the table: R27 releases one boundary later, R30
    # speculates and so releases only what the step confirmed, R28 cuts a device side
    release = "DelayedRelease" if delayed else "ConfirmedRelease" if start == "last_backward" else "ImmediateRelease"
    expected = {"path": StreamedHostUpdate.__name__, "release": release, "split": share != 0.0,
                "speculation": start == "last_backward", "lags": delayed}
    out = get_pool(1, "gloo", timeout_s=120).run(_parts_of_built_path, 1, (_config(*combination),), grace_s=10)[0]
    assert not isinstance(out, RankFailure), f"{combination}: the engine was not built: {out}"
    assert out == expected, f"{combination}: built {out}, expected {expected}"


def _path_for(**changes):
    from optimized.accumulation.update_paths import update_path_class

    base = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "dtype": "bf16"}
    return update_path_class(AccumulationConfig.from_dict({**base, **changes}))


def test_the_streamed_path_is_taken_exactly_where_it_streams():
    """``offload_optimizer: cpu`` streams at stages 2 and 3 with Adam/AdamW; stage 1 and SGD take the plain host
    update."""
    from optimized.accumulation.update_paths import HostUpdate

    assert _path_for() is StreamedHostUpdate
    assert _path_for(zero_stage=3) is StreamedHostUpdate
    assert _path_for(optimizer={"type": "adam"}) is StreamedHostUpdate
    assert _path_for(zero_stage=1) is HostUpdate
    assert _path_for(optimizer={"type": "sgd"}) is HostUpdate


@pytest.mark.parametrize(("changes", "named", "allowed"), [
    ({"gpu_share": 0.5}, "gpu_share=0.5", "gpu_share=0.0"),
    ({"delayed_parameter_update": True}, "delayed_parameter_update=True", "delayed_parameter_update=False"),
    ({"host_update_start": "last_backward"}, "host_update_start='last_backward'", "host_update_start='step'"),
])
def test_a_build_without_the_native_adam_refuses_each_streamed_only_setting(monkeypatch, changes, named, allowed):
    """Without the native CPU Adam nothing streams: a setting only the streamed path has is refused with a
    ConfigurationError that names it and the value that does without it; without such a setting the plain host
    update is taken."""
    import optimized.accumulation.update_paths as paths

    monkeypatch.setattr(paths, "native_adam", lambda optimizer: False)
    assert _path_for() is paths.HostUpdate
    with pytest.raises(ConfigurationError) as info:
        _path_for(**changes)
    assert named in str(info.value) and allowed in str(info.value), str(info.value)
    assert "native CPU Adam" in str(info.value)


def test_the_rows_cannot_be_changed_through_a_path():
    """Every engine of a configuration shares its row: a path that changed its choices would change every later
    engine's, so a row is frozen."""
    import dataclasses

    row = next(iter(STREAMED_CHOICES.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.splits = not row.splits  # type: ignore[misc]

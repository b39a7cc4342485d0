"""The typed config object (R11 dtype resolution, R19 validation) as an implementation exposes it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from hypothesis import given

from conformance.areas.accumulation_strategies import accumulation_configs
from conformance.areas.assertions import assert_names_argument
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")


@given(cfg=accumulation_configs())
def test_R19_config_round_trips_through_a_mapping(area_api, cfg):
    """R19: a config survives to_dict/from_dict and pickling unchanged (what a multi-process runner relies
    on);
    it is immutable."""
    again = area_api.AccumulationConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_stage = 1  # type: ignore[misc]


def test_R11_dtype_defaults_and_overrides(area_api):
    """R11: communication and accumulation dtypes default to the model dtype; each can be set to fp32 or
    bf16."""
    cfg = area_api.AccumulationConfig.from_dict({"dtype": "bf16"})
    assert (cfg.model_dtype, cfg.comm_dtype, cfg.accum_dtype) == (torch.bfloat16,) * 3
    cfg = cfg.replace(communication_data_type="fp32", grad_accum_dtype="fp32")
    assert (cfg.model_dtype, cfg.comm_dtype, cfg.accum_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    assert area_api.AccumulationConfig().comm_dtype == torch.float32


def test_R19_replace_validates_the_combination(area_api):
    """R19: replace() re-validates the whole config, so an invalid combination cannot be reached by editing
    one
    key of a valid one, and an unknown key is named."""
    cfg = area_api.AccumulationConfig(zero_stage=3, offload_param="cpu")
    with pytest.raises(ConfigurationError) as info:
        cfg.replace(zero_stage=2)
    assert_names_argument(info.value, "offload_param")
    with pytest.raises(ConfigurationError) as info:
        cfg.replace(zero_stag=2)
    assert_names_argument(info.value, "zero_stag")


def test_R19_nvme_config_round_trips_and_names_its_directory(area_api, tmp_path):
    """R19/R17: offload_optimizer='nvme' takes nvme_path (a PathLike is stored as str) and nvme_swap (a mapping
    of SwapConfig keys); the config survives to_dict/from_dict and pickling, and replace() away from nvme keeps
    a valid config."""
    from reference.io import SwapConfig

    cfg = area_api.AccumulationConfig.from_dict(
        {"offload_optimizer": "nvme", "nvme_path": tmp_path, "nvme_swap": {"queue_depth": 4, "block_size": 1 << 16}}
    )
    assert cfg.nvme_path == str(tmp_path)
    assert cfg.nvme_swap == SwapConfig(queue_depth=4, block_size=1 << 16)
    assert area_api.AccumulationConfig.from_dict(cfg.to_dict()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.replace(offload_optimizer="cpu").offload_optimizer == "cpu"
    with pytest.raises(ConfigurationError) as info:
        cfg.replace(nvme_path=None)
    assert_names_argument(info.value, "nvme_path")

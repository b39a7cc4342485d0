"""Knob validation: the same errors, naming the knob and its allowed values, in every implementation."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.conformance_area("offload")

BAD_KNOBS = [
    ("mode", "everything", "allowed values"),
    ("min_offload_bytes", -1, r"\[0, "),
    ("min_offload_bytes", 1.5, r"\[0, "),
    ("keep_last_count", True, r"\[0, "),
    ("prefetch_count", -2, r"\[0, "),
    ("max_inflight_bytes", 0, "None"),
    ("pool_bytes", -5, "None"),
    ("use_streams", "yes", "True, False, None"),
    ("hf_integration", 1, "True, False"),
]


@pytest.mark.parametrize(("knob", "value", "allowed"), BAD_KNOBS, ids=[f"{k}={v!r}" for k, v, _ in BAD_KNOBS])
def test_bad_knob_is_rejected_with_its_name(area_api, reference_api, accelerator, knob, value, allowed):
    with pytest.raises(reference_api.ConfigurationError, match=allowed) as impl_err:
        area_api.ActivationOffload(accelerator=accelerator, **{knob: value})
    with pytest.raises(reference_api.ConfigurationError) as ref_err:
        reference_api.ActivationOffload(accelerator=accelerator, **{knob: value})
    assert knob in str(impl_err.value), str(impl_err.value)
    assert str(impl_err.value) == str(ref_err.value)
    assert isinstance(impl_err.value, ValueError)


def test_unknown_knob_lists_allowed(area_api, accelerator):
    with pytest.raises(area_api.ConfigurationError, match="keep_last_count") as err:
        area_api.ActivationOffload(accelerator=accelerator, keep_last=3)
    assert "keep_last" in str(err.value)


def test_same_config_object(area_api, reference_api):
    assert area_api.OffloadConfig is reference_api.OffloadConfig
    cfg = area_api.OffloadConfig(mode="checkpoint_inputs", prefetch_count=0)
    manager = area_api.ActivationOffload(cfg, keep_last_count=4)
    assert manager.config.mode == "checkpoint_inputs" and manager.config.keep_last_count == 4


def test_same_public_names(area_api, reference_api):
    assert sorted(area_api.__all__) == sorted(reference_api.__all__)


def test_streams_on_a_device_without_streams(area_api, accelerator):
    if accelerator.supports_streams:
        pytest.skip(f"accelerator {accelerator.name} has streams")
    with pytest.raises(area_api.ConfigurationError, match="use_streams"):
        area_api.ActivationOffload(accelerator=accelerator, use_streams=True)


def test_bad_accelerator_argument(area_api):
    with pytest.raises(area_api.ConfigurationError, match="accelerator"):
        area_api.ActivationOffload(accelerator=42)

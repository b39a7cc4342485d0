"""Knob validation: the same errors, naming the knob and its allowed values, in every implementation."""

from __future__ import annotations

import pytest

from conformance.areas.assertions import assert_names_argument

pytestmark = pytest.mark.conformance_area("offload")

#: (knob, bad value, the allowed values docs/offload.md lists by name: an int range is the implementation's to word).
BAD_KNOBS = [
    ("mode", "everything", ("all", "checkpoint_inputs")),
    ("min_offload_bytes", -1, ()),
    ("min_offload_bytes", 1.5, ()),
    ("keep_last_count", True, ()),
    ("prefetch_count", -2, ()),
    ("max_inflight_bytes", 0, ("None",)),
    ("pool_bytes", -5, ("None",)),
    ("use_streams", "yes", ("True", "False", "None")),
    ("hf_integration", 1, ("True", "False")),
]


@pytest.mark.parametrize(("knob", "value", "allowed"), BAD_KNOBS, ids=[f"{k}={v!r}" for k, v, _ in BAD_KNOBS])
def test_bad_knob_is_rejected_with_its_name(area_api, reference_api, accelerator, knob, value, allowed):
    """The reference's error class (a ValueError), naming the knob and the values it allows; the wording is the
    implementation's own."""
    with pytest.raises(reference_api.ConfigurationError) as impl_err:
        area_api.ActivationOffload(accelerator=accelerator, **{knob: value})
    assert_names_argument(impl_err.value, knob, *allowed)
    assert isinstance(impl_err.value, ValueError)


def test_unknown_knob_lists_allowed(area_api, accelerator):
    """The unknown knob is named, and the allowed ones are listed."""
    with pytest.raises(area_api.ConfigurationError) as err:
        area_api.ActivationOffload(accelerator=accelerator, keep_last=3)
    assert_names_argument(err.value, "keep_last", "keep_last_count", "prefetch_count", "mode")


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
    with pytest.raises(area_api.ConfigurationError) as err:
        area_api.ActivationOffload(accelerator=accelerator, use_streams=True)
    assert_names_argument(err.value, "use_streams")


def test_bad_accelerator_argument(area_api):
    with pytest.raises(area_api.ConfigurationError) as err:
        area_api.ActivationOffload(accelerator=42)
    assert_names_argument(err.value, "accelerator")

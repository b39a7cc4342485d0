"""The split's contract helpers (reference/contract/accumulation_split.py, R28), held to figures written here.

The suite's split tests compare an implementation with the reference, and both read these helpers, so a slip in
one of them (a byte count, the default budget, the warning's condition, what a measurement accepts) moves both
sides alike and no comparison sees it: mutation testing found 25 such survivors (issue 50). Each expectation below
is stated from the rule's own text (docs/accumulation.md R28, docs/zero.md), not from the code.
"""

from __future__ import annotations

import math
import warnings

import pytest

from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_partition import FLAT_ALIGNMENT
from reference.contract.accumulation_split import (
    DevicelessSplitWarning,
    SplitMeasurement,
    choose_split,
    default_budget,
    device_bytes_per_element,
    fixed_split,
    sample_within,
    warn_if_auto_without_device,
)

pytestmark = pytest.mark.conformance_area("harness")


def _config(**changes) -> AccumulationConfig:
    base = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "dtype": "bf16",
            "grad_accum_dtype": "fp32"}
    return AccumulationConfig.from_dict({**base, **changes})


@pytest.mark.parametrize(("changes", "expected"), [
    ({}, 16),  # fp32 master 4 + two fp32 moments 8 + fp32 accumulated gradient 4
    ({"state_precision": "bf16"}, 12),  # R29: the moments at 2 bytes each
    ({"grad_accum_dtype": "bf16"}, 14),  # the accumulated gradient at 2 bytes
    ({"optimizer": {"type": "sgd", "momentum": 0.9}}, 12),  # one momentum buffer, fp32 whatever the precision
])
def test_device_bytes_per_element(changes, expected):
    assert device_bytes_per_element(_config(**changes)) == expected


def test_the_measurement_sample_fits_the_room_the_limit_leaves():
    """Without a limit the sample is what was asked; under one, no more elements than the room holds at an fp32
    master and gradient (8 bytes) plus the moments (8 at fp32, 4 at bf16), and never fewer than one."""
    fp32, bf16 = _config(), _config(state_precision="bf16")
    assert sample_within(1000, None, fp32) == 1000
    assert sample_within(1000, 16 * 300, fp32) == 300
    assert sample_within(1000, 16 * 300 + 15, fp32) == 300
    assert sample_within(1000, 12 * 300, bf16) == 300
    assert sample_within(100, 16 * 300, fp32) == 100
    assert sample_within(1000, 0, fp32) == 1


def test_the_default_budget_is_half_the_free_memory():
    assert default_budget(None) is None
    assert default_budget(1000) == 500
    assert default_budget(1001) == 500


@pytest.mark.parametrize(("share", "device", "warns"), [
    ("auto", "cpu", True), ("auto", "cuda", False), (0.5, "cpu", False), (0.0, "cpu", False),
])
def test_auto_on_the_host_warns_once_and_says_how_to_silence_it(share, device, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_if_auto_without_device(_config(gpu_share=share), device) is warns
    ours = [w for w in caught if issubclass(w.category, DevicelessSplitWarning)]
    assert len(ours) == (1 if warns else 0)
    if warns:
        assert "gpu_share=0.0" in str(ours[0].message) and "cpu" in str(ours[0].message)


@pytest.mark.parametrize("bad", [-1e-9, math.inf, math.nan, "1", None])
@pytest.mark.parametrize("field", ["host_s_per_element", "device_s_per_element", "hide_s"])
def test_a_measurement_is_finite_and_not_negative(field, bad):
    values = {"host_s_per_element": 1e-9, "device_s_per_element": 1e-10, "hide_s": 0.0, "sample_elements": 10}
    with pytest.raises(ValueError, match=field):
        SplitMeasurement(**{**values, field: bad})
    assert SplitMeasurement(**{**values, field: 0}).sample_elements == 10  # 0 (an int) is a measurement


def test_a_fixed_share_and_an_auto_choice_in_figures():
    """A numeric share cuts at the aligned multiple below ``share * P``; "auto" cuts the smallest aligned part
    whose device time lets the host part hide, within the budget (whole elements only)."""
    cfg = _config()
    d = fixed_split(0.5, 1024, cfg)
    assert (d.device_elements, d.device_bytes, d.auto) == (512, 512 * 16, False) and d.gpu_share == 0.5
    assert fixed_split(0.0, 0, cfg).gpu_share == 0.0
    m = SplitMeasurement(host_s_per_element=3.0, device_s_per_element=1.0, hide_s=0.0, sample_elements=8)
    # host (P - d) * 3 = device d * 1 at d = 3P/4
    auto = choose_split(1024, cfg, None, m)
    assert auto.device_elements == 768 and auto.predicted_host_s == 3.0 * 256 and auto.predicted_device_s == 768
    within = choose_split(1024, cfg, 100 * 16 + 15, m)  # the budget holds 100 elements and 15 bytes
    assert within.device_elements == 100 // FLAT_ALIGNMENT * FLAT_ALIGNMENT and within.budget_bytes == 1615
    hidden = SplitMeasurement(host_s_per_element=3.0, device_s_per_element=1.0, hide_s=1e9, sample_elements=8)
    assert choose_split(1024, cfg, None, hidden).device_elements == 0


def test_split_point_in_figures():
    """0 gives 0, 1 gives the whole partition, a share between rounds ``share * P`` (the float's exact value) down
    to the alignment; a share outside [0, 1] is refused."""
    from reference.contract.accumulation_split import split_point

    assert FLAT_ALIGNMENT == 4, "the figures below assume R8's alignment of 4"
    assert split_point(0.0, 1024) == 0 and split_point(1.0, 1024) == 1024
    assert split_point(0.25, 1000) == 248  # 250 down to a multiple of FLAT_ALIGNMENT (4)
    assert split_point(0.3, 1000) == 296  # the float 0.3 is a little below 3/10: 299.99.. elements, then 296
    for bad in (-0.1, 1.1, math.nan):
        with pytest.raises(ValueError, match="share"):
            split_point(bad, 1024)


def test_auto_with_realistic_rates_a_head_start_and_no_measurement():
    """Seconds per element are nanoseconds, not seconds: the choice must not depend on their sum exceeding 1.
    ``hide`` (device work the host part runs beside) shortens the host part to hide; a measurement of zero time
    (nothing to hide) puts nothing on the device."""
    cfg = _config()
    h, g = 3e-9, 1e-9
    plain = choose_split(1024, cfg, None, SplitMeasurement(h, g, 0.0, 8))
    assert plain.device_elements == 768
    head = choose_split(1024, cfg, None, SplitMeasurement(h, g, h * 512, 8))  # (3 P - 1.5 P) / 4 = 3 P / 8
    assert head.device_elements == 384
    assert choose_split(1024, cfg, None, SplitMeasurement(0.0, 0.0, 0.0, 8)).device_elements == 0
    # a device slower than the host still takes the part that balances them: h (P - d) = g d at d = P / 4
    assert choose_split(1024, cfg, None, SplitMeasurement(g, h, 0.0, 8)).device_elements == 256


def test_under_a_limit_the_budget_must_be_the_limits():
    from reference.contract.accumulation_limit import MemoryLimit, limit_margin

    limit = MemoryLimit(limit_bytes=10_000, floor_bytes=5_000, margin_bytes=limit_margin(10_000),
                        budget_bytes=10_000 - 5_000 - limit_margin(10_000))
    m = SplitMeasurement(3e-9, 1e-9, 0.0, 8)
    cfg = _config()
    assert choose_split(1024, cfg, limit.budget_bytes, m, limit).memory_limit == limit
    with pytest.raises(ValueError, match="budget"):
        choose_split(1024, cfg, limit.budget_bytes + 1, m, limit)


def test_measurements_and_decisions_are_frozen():
    """A decision is reported and logged as made; a measurement is shared by every rank's choice."""
    import dataclasses

    m = SplitMeasurement(3e-9, 1e-9, 0.0, 8)
    d = choose_split(1024, _config(), None, m)
    for obj, name in ((m, "hide_s"), (d, "device_elements")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)


def _engine_constructor(config: AccumulationConfig) -> None:
    warn_if_auto_without_device(config, "cpu")  # what an engine's __init__ does


def test_the_deviceless_warning_points_at_the_line_that_built_the_engine():
    """``stacklevel``: the warning names the user's line that constructed the engine, not the contract's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _engine_constructor(_config(gpu_share="auto")); line = __import__("inspect").currentframe().f_lineno  # noqa: E702
    (w,) = [w for w in caught if issubclass(w.category, DevicelessSplitWarning)]
    assert (w.filename, w.lineno) == (__file__, line)

"""The accumulation schedule's contract (reference/contract/accumulation_schedule.py, R2-R6, R18, R20), held to
figures written here.

Every engine -- the reference's and each implementation's -- answers its counters and boundary calls from this one
class, so a slip in it moves both sides of every trace comparison alike and no conformance test sees it: a
mutation run found the boundary rule's off-by-ones and the counters' initial values surviving (issue 50). Each
expectation below is stated from the rule's text in docs/accumulation.md, not from the code.
"""

from __future__ import annotations

import pytest

from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_schedule import AccumulationSchedule
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

pytestmark = pytest.mark.conformance_area("harness")


def _schedule(gas: int = 3, managed: bool = True, stage: int = 1, world: int = 2, micro: int = 4):
    cfg = AccumulationConfig.from_dict({"zero_stage": stage, "gradient_accumulation_steps": gas,
                                        "managed_gradient_accumulation": managed,
                                        "train_micro_batch_size_per_gpu": micro})
    return AccumulationSchedule(cfg, world, stage)


def _steps(s: AccumulationSchedule, n: int, backwards: int = 1) -> list[bool]:
    out = []
    for _ in range(n):
        for _ in range(backwards):
            s.backward_done()
        with s.step() as boundary:
            out.append(boundary)
    return out


def test_a_new_schedule_starts_at_zero_before_its_first_boundary():
    s = _schedule()
    assert s.counters() == {"micro_steps": 0, "global_steps": 0, "global_samples": 0, "boundary_override": None}
    assert s.is_boundary() is False and s.in_no_sync is False


@pytest.mark.parametrize("gas", [1, 2, 3, 5])
def test_R2_every_gas_th_step_is_a_boundary_and_the_counters_follow(gas):
    """R2-R4: step k (1-based) is a boundary when k is a multiple of gas; micro_steps counts steps, global_steps
    boundaries, global_samples micro-batch x world x gas per boundary."""
    s = _schedule(gas=gas)
    flags = _steps(s, 2 * gas + 1)
    assert flags == [(k + 1) % gas == 0 for k in range(2 * gas + 1)]
    boundaries = (2 * gas + 1) // gas
    assert s.micro_steps == 2 * gas + 1 and s.global_steps == boundaries
    assert s.global_samples == boundaries * (4 * 2 * gas)


def test_R2_the_override_holds_until_called_again_and_is_checked():
    s = _schedule(gas=3)
    s.set_boundary(True)
    assert _steps(s, 2) == [True, True] and s.counters()["boundary_override"] is True
    s.set_boundary(False)
    assert _steps(s, 3) == [False, False, False]
    with pytest.raises(ConfigurationError, match="is_boundary"):
        s.set_boundary(1)  # type: ignore[arg-type]


def test_R6_R20_unmanaged_every_step_is_the_boundary_and_samples_count_backwards():
    """R6: unmanaged, the boundary is exactly "inside step()"; samples count the backwards since the last one;
    micro_steps does not move (the caller drives the accumulation). R20: no override."""
    s = _schedule(gas=3, managed=False)
    assert s.is_boundary() is False
    assert _steps(s, 1, backwards=2) == [True]
    assert _steps(s, 1, backwards=1) == [True]
    assert s.is_boundary() is False
    assert (s.micro_steps, s.global_steps, s.global_samples) == (0, 2, 4 * 2 * 3)
    with pytest.raises(UnsupportedOperationError, match="managed_gradient_accumulation"):
        s.set_boundary(True)


def test_a_step_that_raised_did_not_happen():
    s = _schedule(gas=1)
    with pytest.raises(RuntimeError, match="boom"), s.step():
        raise RuntimeError("boom")
    assert s.counters()["micro_steps"] == 0 and s.global_steps == 0


def test_R18_no_sync_rules():
    """Stages 0/1 only; not nested; no step() inside; the region is visible while open and closed after."""
    s = _schedule(stage=1)
    with s.no_sync():
        assert s.in_no_sync is True
        with pytest.raises(UnsupportedOperationError, match="nested"), s.no_sync():
            pass
        with pytest.raises(UnsupportedOperationError, match="inside no_sync"), s.step():
            pass
    assert s.in_no_sync is False
    with pytest.raises(UnsupportedOperationError, match="zero_stage=2"), _schedule(stage=2).no_sync():
        pass


def test_restored_counters_resume_with_no_backward_counted():
    s = _schedule(gas=2, managed=False)
    s.backward_done()
    s.restore_counters({"micro_steps": 5, "global_steps": 2, "global_samples": 16, "boundary_override": None})
    assert _steps(s, 1, backwards=0) == [True]
    assert s.global_samples == 16, "a backward before the restore was counted after it"

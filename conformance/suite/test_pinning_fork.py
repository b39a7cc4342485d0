"""fork() after native pinning: the one rule both implementations follow (docs/native.md, "fork()").

In a forked child no buffer pinned before the fork is pinned: ``is_pinned`` is False for it and its views, its range
is gone from the implementation's global registry, ``unpin`` returns False, ``pinned_stats`` counts it only as
``unpinned_alive`` until its last view dies, and its bytes stay readable. The parent is unaffected. Pinning works
in the child at once, also when other threads of the parent were pinning and unpinning at the moment of the fork.

The probe (conformance/probes/fork.py) forks in a fresh interpreter; page-locked memory is read from
``/proc/self/status`` in each process, never from the implementation's counters: a child that reported an
inherited buffer pinned would be wrong twice, since the kernel never copies page locks to a child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.conformance_area("pinning"), pytest.mark.runs_in_subprocesses]


_reports: dict[tuple[str, str], dict] = {}


@pytest.fixture
def fork_report(impl) -> dict:
    """The probe's observations for this implementation; one probe run serves every test of this module."""
    key = (impl.areas["pinning"], impl.areas["ranges"])
    if key not in _reports:
        _reports[key] = _run_probe(*key)
    return _reports[key]


def _run_probe(pinning: str, ranges: str) -> dict:
    # The rule is about host memory; the host-only accelerator keeps the child free of a device context (torch
    # refuses CUDA in a child of a process that initialised it, which is torch's rule, not this one).
    env = {**os.environ, "HOSTOFFLOAD_PIN_BACKEND": "native", "HOSTOFFLOAD_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.probes.fork", pinning, ranges],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"the fork probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(report: dict) -> dict:
    child = report["single"]["child"]
    assert child["ok"], f"the forked child failed: {child.get('error')}"
    return child


@pytest.mark.requires(pin_backends="native")
def test_parent_state_is_a_real_pin(impl, fork_report):
    """Sanity of the setup: in the parent the buffer is pinned and the kernel says so (else the rest proves little)."""
    s = fork_report["single"]
    before, buffer_kib = s["parent_before"], fork_report["buffer"] // 1024
    assert s["unpinned_ok"], "unpin of the second buffer returned False in the parent"
    assert before["is_pinned"] and before["view_is_pinned"] and before["in_registry"], before
    assert before["vmlck_kib"] - s["baseline"]["vmlck_kib"] >= buffer_kib, before


@pytest.mark.requires(pin_backends="native")
def test_child_sees_no_inherited_pin(impl, fork_report):
    child, s = _child(fork_report), fork_report["single"]
    inherited = child["inherited"]
    assert inherited["vmlck_kib"] < fork_report["buffer"] // 1024, (
        f"the child holds {inherited['vmlck_kib']} KiB locked right after fork; the kernel copies no page locks, "
        "so the probe's premise does not hold here"
    )
    assert not inherited["is_pinned"], "a buffer pinned before fork() is reported pinned in the child (VmLck says not)"
    assert not inherited["view_is_pinned"], "a view of a buffer pinned before fork() is reported pinned in the child"
    assert not inherited["in_registry"], "the child's global registry still holds the inherited buffer's range"
    parent_stats = s["parent_before"]["stats"]
    live = parent_stats[0] + parent_stats[3]  # pinned + unpinned-but-alive allocations at the fork
    assert inherited["stats"] == [0, 0, 0, live], (
        f"pinned_stats in the child: {inherited['stats']}; expected nothing pinned and the {live} inherited "
        "allocations as unpinned_alive"
    )
    assert child["values_intact"], "the inherited buffer's bytes changed or became unreadable in the child"


@pytest.mark.requires(pin_backends="native")
def test_child_unpin_of_inherited_is_false_and_harmless(impl, fork_report):
    child = _child(fork_report)
    assert child["unpin_inherited"] is False, "unpin of an inherited buffer returned True in the child"
    assert child["unpin_inherited_unpinned"] is False
    assert child["after_unpin"] == child["inherited"], "unpin of an inherited buffer changed the child's state"


@pytest.mark.requires(pin_backends="native")
def test_child_pins_its_own_memory(impl, fork_report):
    child, buffer_kib = _child(fork_report), fork_report["buffer"] // 1024
    own = child["own"]
    assert own["is_pinned"], "a buffer pinned in the child is not pinned"
    assert own["vmlck_grew_kib"] >= buffer_kib, f"pinning {buffer_kib} KiB in the child locked {own['vmlck_grew_kib']}"
    assert own["stats"][:2] == [1, fork_report["buffer"]], own["stats"]
    assert child["own_copy_pinned"], "pin_memory in the child did not give pinned memory"
    assert child["own_unpin"] and not child["own_after_unpin"]["is_pinned"]
    assert child["own_after_unpin"]["vmlck_grew_kib"] == 0, "unpin in the child left pages locked"


@pytest.mark.requires(pin_backends="native")
def test_rule_holds_in_every_generation(impl, fork_report):
    child = _child(fork_report)
    grandchild = child["grandchild"]
    assert grandchild["ok"], f"the grandchild failed: {grandchild.get('error')}"
    assert not grandchild["inherited"]["is_pinned"] and not grandchild["inherited"]["in_registry"], grandchild
    assert grandchild["unpin"] is False
    kept = child["kept_after_grandchild"]
    assert kept["is_pinned"] and kept["in_registry"], "the grandchild's fork changed the child's own pin"
    assert child["kept_unpin"], "unpin in the child after a grandchild ran returned False"


@pytest.mark.requires(pin_backends="native")
def test_inherited_buffers_are_released_with_their_last_view(impl, fork_report):
    child, s = _child(fork_report), fork_report["single"]
    assert child["after_drop"] == {"stats": [0, 0, 0, 0], "vmlck_kib": 0, "ranges": s["baseline"]["ranges"]}, (
        f"after the child dropped every tensor: {child['after_drop']}"
    )


@pytest.mark.requires(pin_backends="native")
def test_parent_is_unaffected_by_the_child(impl, fork_report):
    s = fork_report["single"]
    assert s["parent_after"] == s["parent_before"], "the child's fork or its actions changed the parent's state"
    assert s["parent_unpin"], "unpin in the parent after the fork returned False"
    assert not s["parent_after_unpin"]["is_pinned"]
    assert s["parent_after_unpin"]["vmlck_kib"] == s["baseline"]["vmlck_kib"], "unpin in the parent left pages locked"
    assert s["parent_end"] == {**s["baseline"]}, f"the parent did not return to its baseline: {s['parent_end']}"


@pytest.mark.requires(pin_backends="native")
def test_fork_while_other_threads_pin(impl, fork_report):
    """Locks held by other threads at the fork must not be inherited locked, nor their half-made pins pinned."""
    t = fork_report["threaded"]
    assert not t["worker_errors"], t["worker_errors"]
    assert min(t["churned"]) > 0, "the worker threads did not run; the forks raced nothing"
    baseline_ranges = fork_report["single"]["baseline"]["ranges"]
    for i, child in enumerate(t["children"]):
        assert child["ok"], f"child {i} of a fork during pinning failed: {child.get('error')}"
        start = child["start"]
        assert start["stats"][:3] == [0, 0, 0], f"child {i} starts with inherited pins counted: {start['stats']}"
        assert start["ranges"] == baseline_ranges, f"child {i} inherited {start['ranges']} ranges in its registry"
        assert start["vmlck_kib"] == 0
        assert child["own_pinned"] and child["own_vmlck_grew_kib"] >= fork_report["small"] // 1024, child
        assert child["own_unpinned"], child
    assert t["end"] == {"stats": [0, 0, 0, 0], "vmlck_kib": 0, "ranges": baseline_ranges}, t["end"]

"""The warn-and-keep-the-lock rule when a device refuses host registration (docs/native.md, "When an accelerator
hook fails"), checked on CPU with :class:`reference.contract.accelerators.refusing.RefusingHostAccelerator`.

It runs in a fresh interpreter: the warning is once per process, so only a process that has not pinned before
can show whether it comes (and comes once). The probe installs the refusing accelerator in that process's
accelerator registry (the one every implementation resolves ``HOSTOFFLOAD_ACCELERATOR`` through), pins through
the implementation's public calls, and reports what the harness observes: the hook calls, the warnings, VmLck,
``is_pinned`` and ``pinned_stats()``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.conformance_area("pinning")

_PROBE = """
import gc, importlib, json, os, sys, warnings
os.environ["HOSTOFFLOAD_PIN_BACKEND"] = "native"
os.environ.pop("HOSTOFFLOAD_PIN_REGISTER_DEVICE", None)
import torch
from reference.contract import accelerators
from reference.contract.accelerators.refusing import RefusingHostAccelerator
from conformance.harness.observation import vm_locked_kib
device = RefusingHostAccelerator()
accelerators.discover_accelerators()
accelerators._instances[device.name] = device
os.environ["HOSTOFFLOAD_ACCELERATOR"] = device.name
api = importlib.import_module(sys.argv[1])
gc.collect()
s0, locked0 = api.pinned_stats(), vm_locked_kib()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = api.pin_empty(3 * 4096 + 5, dtype=torch.uint8)
    b = api.pin_memory(torch.arange(1000, dtype=torch.float32))
    a.fill_(7)
s1, locked1 = api.pinned_stats(), vm_locked_kib()
out = {
    "register_calls": len(device.register_calls),
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "pinned": [api.is_pinned(a), api.is_pinned(b), api.is_pinned(a[5:9])],
    "values": bool((a == 7).all()) and torch.equal(b, torch.arange(1000, dtype=torch.float32)),
    "locked_growth_kib": locked1 - locked0,
    "allocations": s1.allocations - s0.allocations,
    "bytes": s1.bytes - s0.bytes,
    "registered_bytes": s1.registered_bytes - s0.registered_bytes,
    "unpinned": [api.unpin(a), api.unpin(b)],
}
del a, b
gc.collect()
out["unregister_calls"] = len(device.unregister_calls)
out["after"] = [api.pinned_stats() == s0, vm_locked_kib() - locked0]
print(json.dumps(out))
"""


@pytest.mark.requires(pin_backends="native")
def test_refused_registration_warns_once_and_keeps_the_lock(impl):
    """Two allocations on a device that refuses each registration: both stay page-locked (VmLck grows by their
    pages), pinned (``is_pinned``, also of a view), counted in ``pinned_stats()`` but not as registered, their
    values intact; one RuntimeWarning names the accelerator; unpin works, and the unregister hook is never
    called for memory that was never registered."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, impl.areas["pinning"]], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"probe exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["register_calls"] == 2, f"the register hook ran {got['register_calls']} times for 2 allocations"
    assert got["pinned"] == [True, True, True], f"refused registration must keep the buffers pinned: {got}"
    assert got["values"], "a buffer whose registration was refused does not hold its values"
    assert got["locked_growth_kib"] >= (4 + 1) * 4, f"VmLck grew by {got['locked_growth_kib']} KiB only: {got}"
    assert (got["allocations"], got["registered_bytes"]) == (2, 0) and got["bytes"] >= 5 * 4096, (
        f"pinned_stats after two refused registrations: {got}"
    )
    refusals = [w for w in got["warnings"] if w.startswith("RuntimeWarning") and "cpu-refusing-registration" in w]
    assert len(refusals) == 1 and len(got["warnings"]) == 1, f"want one RuntimeWarning naming the device: {got}"
    assert got["unpinned"] == [True, True], f"unpin of a locked, unregistered buffer: {got['unpinned']}"
    assert got["unregister_calls"] == 0, "the unregister hook was called for memory the device never registered"
    assert got["after"] == [True, 0], f"pinned_stats / VmLck not back after the buffers died: {got['after']}"

"""Lock failure: a clear MemoryError that names ``ulimit -l``, and nothing left behind.

The child process drops CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK otherwise), lowers RLIMIT_MEMLOCK to 64 KiB,
checks that a small pin still works, then asks for 8 MiB. Afterwards VmLck, the mapping count, the thread count
and pinned_stats must equal their values before the failed call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.conformance_area("pinning")

LIMIT = 64 * 1024
REQUEST = 8 * 1024 * 1024


@pytest.mark.requires(pin_backends="native")
def test_lock_failure_is_clear_and_leaks_nothing(impl, accelerator):
    env = {**os.environ, "HOSTOFFLOAD_PIN_BACKEND": "native", "HOSTOFFLOAD_ACCELERATOR": accelerator.name}
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.probes.memlock", impl.areas["pinning"], str(LIMIT), str(REQUEST)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"probe crashed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.getuid() == 0:
        assert result["dropped_cap"], "root could not drop CAP_IPC_LOCK; the limit would not apply"
    assert result["small_pinned"], "a pin below RLIMIT_MEMLOCK failed; the probe would prove nothing"
    err = result["error"]
    assert err is not None, f"pinning {REQUEST} bytes under a {LIMIT}-byte RLIMIT_MEMLOCK succeeded"
    assert err["is_memory_error"], f"expected a MemoryError subclass, got {err['type']}: {err['message']}"
    assert "ulimit -l" in err["message"], f"the message must tell the user about `ulimit -l`: {err['message']}"
    before, after = result["before"], result["after"]
    assert after == before, f"the failed call left something behind: before {before}, after {after}"

"""Deliberately broken implementations for the harness self-tests (never registered by hostoffload itself).

Each is a small, plausible defect a third party could ship; ``conformance.selftest.test_untrusted_plugins``
registers them through a throw-away ``*.dist-info`` entry-point file on ``PYTHONPATH`` (exactly how an installed
package is found) and checks that the right test flags each one while the run still completes with its report:

- ``selftest-abort``: ``pin_empty`` calls ``abort()`` (a native assert): crash isolation must turn it into one
  failed test naming SIGABRT, and the other tests must still run.
- ``selftest-leak``: a failed ``pin_empty`` call leaves locked memory behind that ``pinned_stats()`` does not
  count: the harness's own observation (VmLck) must catch it.
- ``selftest-linear``: a range registry whose lookups scan every range: the cost-growth property must fail it.
- ``selftest-foreign-engine``: a distributed engine that is not ours (it keeps pinned copies of its buffers
  on ``destroy()``): the engine tests must drive this engine, not ours, and flag it.
- ``selftest-stranger``: a third party's pinning with only the public calls (no range registry), forwarding to
  another library and keeping its own table: it asserts (SIGABRT) on an empty ``pin_empty``, frees a large
  buffer's pages while a view still reads them (SIGSEGV), races on its unlocked table and scans it linearly
  (:mod:`conformance.selftest.plugins.stranger_pinning`). Each behaviour must be flagged by one test, and the
  run must still complete with a consistent junit XML, ``-ra`` summary and report.
- ``selftest-missing-area``: declares the pinning area, but its module was not shipped: every pinning test must be
  skipped with that reason, none run.
"""

from __future__ import annotations

from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation

_PLUGINS = "conformance.selftest.plugins"

ABORTING = Implementation(
    name="selftest-abort",
    version="0.0.0",
    areas={"pinning": f"{_PLUGINS}.aborting_pinning"},
    capabilities=Capabilities(pin_backends=("torch", "native")),
)

LEAKING = Implementation(
    name="selftest-leak",
    version="0.0.0",
    areas={"pinning": f"{_PLUGINS}.leaking_pinning"},
    capabilities=Capabilities(pin_backends=("torch", "native")),
)

LINEAR = Implementation(
    name="selftest-linear",
    version="0.0.0",
    areas={"ranges": f"{_PLUGINS}.linear_ranges"},
    capabilities=Capabilities(),
)

FOREIGN_ENGINE = Implementation(
    name="selftest-foreign-engine",
    version="0.0.0",
    areas={"pinning": "optimized.pinning", "accumulation": f"{_PLUGINS}.foreign_engine"},
    capabilities=Capabilities(pin_backends=("torch", "native"), distributed_engine=True),
)

STRANGER = Implementation(
    name="selftest-stranger",
    version="0.0.0",
    areas={"pinning": f"{_PLUGINS}.stranger_pinning"},
    capabilities=Capabilities(pin_backends=("torch", "native")),
)

MISSING_AREA = Implementation(
    name="selftest-missing-area",
    version="0.0.0",
    areas={"pinning": f"{_PLUGINS}.not_shipped_pinning"},
    capabilities=Capabilities(pin_backends=("torch", "native")),
)

#: entry-point name -> "module:attribute", what the self-test writes into its entry_points.txt.
ENTRY_POINTS = {
    "selftest-abort": f"{_PLUGINS}:ABORTING",
    "selftest-leak": f"{_PLUGINS}:LEAKING",
    "selftest-linear": f"{_PLUGINS}:LINEAR",
    "selftest-foreign-engine": f"{_PLUGINS}:FOREIGN_ENGINE",
    "selftest-stranger": f"{_PLUGINS}:STRANGER",
    "selftest-missing-area": f"{_PLUGINS}:MISSING_AREA",
}

"""The hostoffload conformance suite: a pytest plugin and the tests it runs against any implementation.

Layout, by role (docs/architecture.md, "The harness"):

- :mod:`conformance.activation` -- the ``pytest11`` entry point (decides whether a session is a conformance run);
- :mod:`conformance.harness` -- the plugin machinery (discovery, options, profiles, report, isolation, rank pool);
- :mod:`conformance.areas` -- per-area helpers (strategies, assertions, the suite's own oracles);
- :mod:`conformance.faults` -- fault and trace tools (filesystem faults and traces, the chaos accelerator);
- :mod:`conformance.probes` -- small programs the suite runs in child processes;
- ``conformance.suite`` -- the tests that judge implementations; ``conformance.selftest`` -- the harness's own.

Until December 2026 the helpers were modules of this package itself (``conformance.assertions``,
``conformance.rank_pool`` ...). Those names still import, with a ``DeprecationWarning`` naming the new one, so a
vendor's own tests written against them keep working while they move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module name (a module of this package before the split into sub-packages) -> its sub-package now
_MOVED = {
    **dict.fromkeys(
        ("plugin", "discovery", "environment", "profiles", "report", "rule_ledger", "capability_marks",
         "option_checks", "optional_packages", "isolation", "isolation_reports", "interface_check", "expectations",
         "doc_rules", "docs_examples", "rank_pool", "engine_runner", "observation"),
        "harness",
    ),
    **dict.fromkeys(
        ("accumulation_assertions", "accumulation_engines", "accumulation_strategies", "assertions", "io_assertions",
         "io_strategies", "offload_assertions", "offload_strategies", "strategies", "stateful", "lr_schedule_oracle",
         "kernel_claims", "cost_growth", "lightning_runs", "checkpoint_machine"),
        "areas",
    ),
    **dict.fromkeys(("chaos", "checkpoint_faults", "fs_trace", "attribute_patches"), "faults"),
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads ``conformance.<old>`` as the module at its new place (the same module object, so state is shared)."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name
        self._own: tuple[object, object] | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new_name}; import it from there", DeprecationWarning,
                      stacklevel=3)
        module = importlib.import_module(self.new_name)
        self._own = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its new name); give it back its own spec and loader, which the
        import system has just replaced with the alias's."""
        if self._own is not None:
            module.__spec__, module.__loader__ = self._own  # type: ignore[assignment]


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(f"{__name__}.{_MOVED[name]}.{name}"))


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

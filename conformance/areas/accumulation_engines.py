"""The distributed engine under test, taken from the implementation's own declaration.

An implementation that declares ``Capabilities(distributed_engine=True)`` provides a ``ZeroEngine`` class in its
accumulation area module (one object per rank on a torch.distributed group) and a pinning area whose
``pinned_stats`` counts the engine's pinned buffers. The engine test modules mark themselves
``requires("distributed_engine", areas=("accumulation", "pinning"))`` and get an :class:`EngineUnderTest` from
:func:`engine_api`: the engine class, the pinning API and the harness's rank runner, all resolved from the
implementation being judged, so a third-party engine is tested as itself and never with ours.

Rank functions run in the harness's worker processes and receive the
:class:`~reference.contract.implementation.Implementation` itself as an argument (it pickles by value), then
resolve the classes they need with :func:`engine_class` and :func:`pinned_stats_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from conformance.harness import engine_runner, rank_pool
from reference.contract.implementation import Implementation

#: The marker every engine test module carries: the feature and the areas the engine tests need.
REQUIRES_ENGINE = pytest.mark.requires("distributed_engine", areas=("accumulation", "pinning"))
#: The marker of the checkpoint tests: the engine's save_checkpoint / load_checkpoint (docs/zero.md).
REQUIRES_CHECKPOINT = pytest.mark.requires(
    "distributed_engine", "accumulation_checkpoint", areas=("accumulation", "pinning")
)
#: The engine's code runs in the rank processes of the harness's pool, so a crash there is already one failed
#: test: crash isolation would only add a pool start per test.
IN_RANK_PROCESSES = pytest.mark.runs_in_subprocesses


def engine_class(impl: Implementation) -> type:
    """The implementation's per-rank engine class (``ZeroEngine`` of its accumulation area)."""
    module = impl.load("accumulation")
    cls = getattr(module, "ZeroEngine", None)
    if not isinstance(cls, type):
        raise AssertionError(
            f"{impl.name} declares distributed_engine but its accumulation module {module.__name__} has no "
            f"ZeroEngine class (docs/extending.md)"
        )
    return cls


def pinned_stats_of(impl: Implementation):
    """The implementation's ``pinned_stats`` (its pinning area), the counter the release checks compare."""
    return impl.load("pinning").pinned_stats


@dataclass(frozen=True)
class EngineUnderTest:
    """What the engine tests drive: the implementation's engine class and the harness's rank runner."""

    impl: Implementation

    TIMEOUT_ENV = engine_runner.TIMEOUT_ENV
    POOL_SIZE_ENV = engine_runner.POOL_SIZE_ENV

    @property
    def ZeroEngine(self) -> type:
        return engine_class(self.impl)

    @property
    def pinning(self) -> ModuleType:
        return self.impl.load("pinning")

    @staticmethod
    def run_on_ranks(fn: Any, world: int, *args: Any, **kwargs: Any) -> list[Any]:
        return engine_runner.run_on_ranks(fn, world, *args, **kwargs)

    def run_scenario(self, scenario: Any, **kwargs: Any):
        return engine_runner.run_engine_scenario(self.ZeroEngine, scenario, **kwargs)

    @staticmethod
    def shutdown_pools() -> None:
        rank_pool.shutdown_pools()


class HarnessScenarioArea(ModuleType):
    """An accumulation area module as the suite drives it when the implementation leaves ``run_scenario`` to the
    harness (it declares ``distributed_engine`` and has no ``run_scenario`` of its own; see
    ``reference.contract.interfaces.ScenarioRunner``): every name of the module, read through, plus
    ``run_scenario`` on the implementation's declared ``ZeroEngine`` in the harness's rank processes."""

    def __init__(self, impl: Implementation, module: ModuleType) -> None:
        super().__init__(module.__name__, module.__doc__)
        self._impl = impl
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def run_scenario(self, scenario: Any, *, backend: str | None = None,
                     bucket_elements: int = engine_runner.SCENARIO_BUCKET_ELEMENTS) -> Any:
        return engine_runner.run_engine_scenario(engine_class(self._impl), scenario, backend=backend,
                                                 bucket_elements=bucket_elements)


def scenario_area(impl: Implementation, module: ModuleType) -> ModuleType:
    """``module`` (``impl``'s accumulation area) with a ``run_scenario``: its own where it has one, else the
    harness's on its declared engine; without either, the module as it is (the interface test names the gap)."""
    if hasattr(module, "run_scenario") or not impl.capabilities.distributed_engine:
        return module
    return HarnessScenarioArea(impl, module)


def engine_api(impl: Implementation) -> EngineUnderTest:
    """The engine of ``impl``. Modules marked with :data:`REQUIRES_ENGINE` are skipped at collection for an
    implementation that does not declare one, so reaching this without the declaration is a harness error."""
    if not impl.capabilities.distributed_engine:
        raise pytest.UsageError(f"engine_api({impl.name}) called from a test without {REQUIRES_ENGINE.args}")
    return EngineUnderTest(impl)


@pytest.fixture
def native_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native pin backend without device registration: engine buffers are then page-locked, recorded in the
    range registry and counted by ``pinned_stats``, which is what the release and direct-swap checks read."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")

"""Type stub for the compiled extension built from csrc/ (absent where the package is not built, e.g. the typecheck
env): its callables are typed Any at the Python call sites."""

from typing import Any

def __getattr__(name: str) -> Any: ...

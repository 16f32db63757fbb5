"""Import a script from ``tools/`` as a module, for tests of the benchmarks (``tools/`` is not a package)."""
import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@contextlib.contextmanager
def loaded_tool(name: str) -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up in sys.modules
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)

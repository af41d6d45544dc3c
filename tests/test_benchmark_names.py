"""No script in benchmarks/ is named like an installed module: running `python benchmarks/x.py` puts benchmarks/ first
on the path, where a `kernels.py` once shadowed the `kernels` package that transformers imports, and every script
there failed at `import transformers` (and so did engine processes spawned by tests that put benchmarks/ on it)."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_script_shadows_an_installed_module():
    elsewhere = [entry for entry in sys.path if entry and Path(entry).resolve() != BENCHMARKS]
    names = sorted({path.stem for path in BENCHMARKS.glob("*.py")})
    assert "speculative" in names  # the glob found the scripts
    shadowing = [name for name in names if importlib.machinery.PathFinder.find_spec(name, elsewhere) is not None]
    shadowing += [name for name in names if name in sys.builtin_module_names]
    assert not shadowing, f"benchmarks/ scripts named like installed modules: {shadowing}"

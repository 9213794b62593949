"""The shape of the package: the planner and the layout arithmetic import no torch, and the
planner imports nothing of the runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gridtrain"


def modules(folder: str) -> list[str]:
    """Every module under gridtrain/<folder>, subfolders included."""
    return sorted("gridtrain." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
                  for p in (PACKAGE / folder).rglob("*.py") if p.stem != "__init__")


TORCH_FREE = modules("plan") + modules("layout") + modules("explore") + ["gridtrain.argtypes",
    "gridtrain.config", "gridtrain.config_load", "gridtrain.names", "gridtrain.validate", "gridtrain.rundir",
    "gridtrain.errors", "gridtrain.model.args", "gridtrain.parity.matrix", "gridtrain.runlock"]


def test_the_planner_and_the_layout_core_import_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def imports_of(folder: str) -> list[tuple[str, str]]:
    """(file:line, imported module) for every import under gridtrain/<folder>, deferred ones
    included (they would load their module the moment the code runs them)."""
    out = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out += [(f"{path.relative_to(PACKAGE)}:{node.lineno}", name) for name in names]
    return out


def test_the_planner_and_the_layout_core_import_nothing_of_the_runtime():
    """plan/ and layout/ name neither train/, nor parallel/ (the torch half), nor torch; the
    explorer reads runs' metrics (train/metrics.py, torch-free: TORCH_FREE above) and nothing else
    of the runtime."""
    broken = [f"{where} imports {name}" for folder in ("plan", "layout", "explore") for where, name in imports_of(folder)
              if name.startswith(("gridtrain.train", "gridtrain.parallel", "torch"))
              and not (folder == "explore" and name == "gridtrain.train.metrics")]
    assert broken == []


def test_parallelism_imports_nothing_of_the_training_loop():
    broken = [f"{where} imports {name}" for where, name in imports_of("parallel") if name.startswith("gridtrain.train")]
    assert broken == []

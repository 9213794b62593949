"""The shape of the package: the planner and the layout arithmetic import no torch, and the
planner imports nothing of the runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gridtrain"
TORCH_FREE = sorted(f"gridtrain.plan.{p.stem}" for p in (PACKAGE / "plan").glob("*.py") if p.stem != "__init__") + [
    "gridtrain.parallel.dims", "gridtrain.config", "gridtrain.checks", "gridtrain.rundir", "gridtrain.errors",
    "gridtrain.model.args", "gridtrain.parity.matrix"]


def test_the_planner_and_the_layout_core_import_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_planner_imports_nothing_of_the_runtime():
    """No module under plan/ names train/ or the torch half of parallel/ in an import, deferred
    imports included (they would load torch the moment the planner runs them)."""
    broken = []
    for path in sorted((PACKAGE / "plan").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith(("gridtrain.train", "torch")) or (
                        name.startswith("gridtrain.parallel") and name != "gridtrain.parallel.dims"):
                    broken.append(f"{path.name}:{node.lineno} imports {name}")
    assert broken == []

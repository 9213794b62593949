"""Torchrun launches shared by the test modules: one per world size for the cases of every
selected module that declares them.

Starting the processes costs more than most cases: each imports torch and DTensor (about 2 s),
so a launch of 8 processes on this 2-core machine spends at least 8 s before its first case,
and CI started a launch of each world size from each of seven modules. A module declares its
cases with a module-level function

    def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict]]:
        return {world: {name: overrides, ...}, ...}

and reads them with the `launches` fixture: `launches.out(__name__, world)` is the folder in
which its cases wrote what `gridtrain.parity.run` writes (NAME.pp0.pt, NAME/, ...), as if it had
launched them alone. The cases run in the order of the modules' names, each module's in its
own order; a case that raises ends the launch, and every module reading it fails with its error.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType


class Launches:
    def __init__(self, modules: list[ModuleType], work: Path, corpus: Path) -> None:
        self.work, self.corpus = work, corpus
        self.modules = sorted(modules, key=lambda m: m.__name__)
        self._cases: dict[str, dict[int, dict[str, dict]]] | None = None
        self._done: dict[int, subprocess.CompletedProcess] = {}

    def cases(self) -> dict[str, dict[int, dict[str, dict]]]:
        """Every module's cases by world size (asked once, in the modules' own work folders)."""
        if self._cases is None:
            self._cases = {m.__name__: m.launch_cases(self.work / m.__name__, self.corpus) for m in self.modules}
        return self._cases

    def out(self, module: str, world: int) -> Path:
        """The folder of `module`'s cases of `world` processes, launched with every other
        module's of that size on first use."""
        cases = self.cases()
        assert world in cases.get(module, {}), f"{module} declares no case of {world} processes"
        launched = self.work / f"world{world}"
        if world not in self._done:
            from gridtrain.parity.run import launch

            spec = {f"{name}/{case}": overrides for name, by_world in cases.items()
                    for case, overrides in by_world.get(world, {}).items()}
            for name, by_world in cases.items():
                if world in by_world:
                    (launched / name).mkdir(parents=True, exist_ok=True)
            self._done[world] = launch(world, spec, launched)
        proc = self._done[world]
        assert proc.returncode == 0, f"the shared launch of {world} processes failed:\n" + proc.stderr[-6000:]
        return launched / module

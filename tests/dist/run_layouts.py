"""Run under torchrun by tests/test_parallel.py: for each case of a JSON spec, train a few steps
in that layout and save, from one rank per pipeline stage, the per-step losses and the gathered
(full) weights of the stages it holds. Several layouts share one launch, since starting processes
dominates the time.

    torchrun --nproc-per-node N tests/dist/run_layouts.py SPEC.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from gridtrain.config import load_config
from gridtrain.train.trainer import Trainer


def run_case(name: str, overrides: dict[str, object], out: Path) -> None:
    cfg = load_config(None, {**overrides, "run_dir": str(out / name)})
    trainer = Trainer(cfg)
    if trainer.world.rank == 0:
        trainer.write_config()
    losses, norms, records = [], [], []
    for _ in range(cfg.train.steps):
        metrics = trainer.train_step()
        losses.append(metrics["loss/train"])
        norms.append(metrics["grad/norm"])
        records.append(json.dumps({"step": trainer.step, **metrics}))
    if trainer.world.rank == 0:  # what Trainer.run logs, for `gridtrain plan --check`'s step time
        (out / name / "metrics.jsonl").write_text("\n".join(records) + "\n")
    weights: dict[str, torch.Tensor] = {}
    for part in trainer.pmodel.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().cpu().clone() for k, v in full.items()})
    if trainer.coords["dp"] == 0 and trainer.coords["tp"] == 0:
        torch.save({"losses": losses, "grad_norms": norms, "weights": weights},
                   out / f"{name}.pp{trainer.coords['pp']}.pt")
    dist.barrier()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name, overrides in spec.items():
        run_case(name, overrides, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

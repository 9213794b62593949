"""The routing imbalance an expert-parallel rank sees, measured on trained MoE runs.

    python bench/bench_moe_load.py [RUN_DIR ...] [--sequences 256]

Under expert parallelism every MoE layer waits, in its all-to-alls and its expert matmuls, for the
rank that receives the most rows: per layer and micro-batch, the max over the ep ranks of the
assignments routed to the E / ep consecutive experts each holds (gridtrain shards the stacked
`[E, ...]` weights by expert, Shard(0)), over their mean. This loads each run's final checkpoint in
one process, routes the run's validation sequences through it (the router's top-k choices, the
expert bias included where the run balanced by it), and for each ep dividing E groups them as an
ep group's micro-batch does: ep x the run's micro-batch of sequences, one micro-batch per rank.
It prints, per run and ep, the mean over layers and groups of that max/mean (what the step's time
sums, layer after layer) and the worst group's, and with --json the figures the planner's
allowance (`gridtrain/plan/moe_cost.py`, ROUTING_IMBALANCE) is stated against.

The default runs are the README's 300-step small-moe runs, 8 experts at top-2 as Mixtral, each in
runs/moe300/NAME: `gridtrain train --model.preset small-moe --model.moe.balance B
[--model.moe.score sigmoid] [--model.moe.bias_update_rate R] --train.steps 300 --run_dir
runs/moe300/NAME` with aux_loss, bias (rate 0.001), bias_0.01, bias_sigmoid_0.01 and none.
The fine-grained routings the planner also reads (32 and 128 experts at top-8, width 96) are
trained the same way with `--model.moe.num_experts E --model.moe.top_k 8
--model.moe.expert_ffn_dim 96` and given as RUN_DIR, with --sequences 1000 (every validation
sequence).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.moe import moe_layers  # noqa: E402
from gridtrain.train.inference import load_run  # noqa: E402
from gridtrain.train.build import prepared_data, val_reader  # noqa: E402

DEFAULT_RUNS = ("aux_loss", "bias", "bias_0.01", "bias_sigmoid_0.01", "none")


def routed_counts(run_dir: Path, sequences: int) -> tuple[torch.Tensor, int, int, int]:
    """(counts of shape (micro-batches, layers, E), experts, sequences per micro-batch, their
    length): the
    router's choices over the run's validation split, one micro-batch at a time."""
    run = load_run(run_dir)
    cfg, model = run.cfg, run.model
    layers = [m for _, m in moe_layers(model)]
    num_experts = layers[0].args.num_experts
    chosen: list[torch.Tensor] = []

    def keep(module, inputs, outputs):  # the router returns (logits, scores, gates, experts)
        chosen.append(torch.bincount(outputs[3].flatten(), minlength=num_experts))

    hooks = [m.router.register_forward_hook(keep) for m in layers]
    reader = val_reader(cfg, prepared_data(cfg))
    mb = cfg.train.micro_batch
    batches = min(sequences, reader.num_samples) // mb
    with torch.no_grad():
        for inputs, _ in reader.batches(mb, batches):
            model(inputs)
    for h in hooks:
        h.remove()
    counts = torch.stack(chosen).view(batches, len(layers), num_experts)
    return counts, num_experts, mb, cfg.data.seq_len


def rank_imbalance(counts: torch.Tensor, ep: int, per_rank: int = 1) -> tuple[float, float]:
    """(mean, max) over layers and ep groups of the busiest rank's rows over the mean rank's: each
    group is ep x per_rank consecutive micro-batches (per_rank on each rank), each rank holding
    E / ep experts."""
    batches, layers, experts = counts.shape
    size = ep * per_rank
    groups = batches // size
    assert groups, f"{batches} micro-batches make no group of {size}"
    grouped = counts[: groups * size].view(groups, size, layers, experts).sum(dim=1)  # the group's tokens
    per_rank = grouped.view(groups, layers, ep, experts // ep).sum(dim=-1).double()
    ratio = per_rank.max(dim=-1).values / per_rank.mean(dim=-1)
    return ratio.mean().item(), ratio.max().item()


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "runs" / "moe300"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", type=Path, default=[root / name for name in DEFAULT_RUNS])
    p.add_argument("--sequences", type=int, default=256, help="validation sequences to route (at most the split's)")
    p.add_argument("--per-rank", type=int, nargs="+", default=[1],
                   help="micro-batches of the run per rank and MoE call (more tokens, less noise)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    table: dict[str, dict[str, object]] = {}
    for run_dir in args.runs:
        counts, experts, mb, seq_len = routed_counts(run_dir, args.sequences)
        for per_rank in args.per_rank:
            row: dict[str, object] = {"tokens_per_rank": per_rank * mb * seq_len, "micro_batches": counts.shape[0]}
            for ep in [d for d in range(2, experts + 1) if experts % d == 0 and counts.shape[0] >= 2 * d * per_rank]:
                mean, worst = rank_imbalance(counts, ep, per_rank)
                row[f"ep{ep}"] = {"experts_per_rank": experts // ep, "mean": round(mean, 3), "max": round(worst, 3)}
            table[f"{run_dir.name}@{per_rank * mb * seq_len}"] = row
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'run':<18} {'tokens/rank':>11} {'ep':>3} {'experts/rank':>12} {'max/mean rows, mean':>20} {'worst':>7}")
    for name, row in table.items():
        run, tokens = name.split("@")
        for key, cell in row.items():
            if key.startswith("ep"):
                assert isinstance(cell, dict)
                print(f"{run:<18} {tokens:>11} {key[2:]:>3} {cell['experts_per_rank']:>12} {cell['mean']:>20.3f} "
                      f"{cell['max']:>7.3f}")
    spread = [row["micro_batches"] for row in table.values()]
    print(f"({statistics.median(spread):.0f} micro-batches routed per run; ep groups with fewer than two "
          "samples are left out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

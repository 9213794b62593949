"""Where a gridtrain step's time goes on this device: torch's profiler over a few steps after a
warm-up, the device time (CPU time where no accelerator is present) summed by op and by kind
(matmuls, attention, optimizer, norms and elementwise, copies and casts), as JSON.

    python bench/gpu/profile_step.py --out prof.json --model.dim 2048 ... (any `gridtrain train` key)

The suite runs it on the 1B shape, where gridtrain trails torchtitan (bench/gpu/suite.py, part
'profile').
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gridtrain.config_load import load_config  # noqa: E402
from gridtrain.train.trainer import Trainer  # noqa: E402

KINDS = (("matmul", ("mm", "addmm", "bmm", "gemm", "matmul", "linear", "cutlass", "sm90")),
         ("attention", ("flash", "attention", "fmha", "sdpa")),
         ("optimizer", ("adam", "foreach", "fused")),
         ("copy_cast", ("copy", "to_copy", "cast", "cat", "clone", "contiguous")),
         ("norm_elementwise", ("norm", "rsqrt", "mul", "add", "silu", "pow", "mean", "sigmoid", "neg", "exp",
                               "elementwise", "vectorized", "reduce", "softmax", "nll", "log")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def main() -> None:
    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1])
    del args[args.index("--out"): args.index("--out") + 2]
    overrides = {args[i].lstrip("-"): args[i + 1] for i in range(0, len(args), 2)}
    trainer = Trainer(load_config(None, overrides))
    for _ in range(3):
        trainer.train_step()
    on_device = trainer.device.type != "cpu"
    activities = [ProfilerActivity.CPU] + ([getattr(ProfilerActivity, trainer.device.type.upper())] if on_device else [])
    steps = 2
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step()
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "self_device_time_total", 0) if on_device else e.self_cpu_time_total) / 1e6 / steps
        if t > 0:
            rows.append({"op": e.key, "s_per_step": t, "calls_per_step": e.count / steps, "kind": kind_of(e.key)})
    rows.sort(key=lambda r: -r["s_per_step"])
    kinds: dict[str, float] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0.0) + r["s_per_step"]
    result = {"device": str(trainer.device), "timed": "device" if on_device else "cpu", "kinds_s_per_step": kinds,
              "total_s_per_step": sum(kinds.values()), "top_ops": rows[:30], "overrides": overrides}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: round(v, 4) for k, v in kinds.items()}))


if __name__ == "__main__":
    main()

"""Peak memory of `gridtrain export` and `gridtrain import` on a model of about 0.78B parameters
(3.1 GB of fp32 weights).

    python bench/bench_export.py                     # work files under /tmp/gridtrain-bench-export
    python bench/bench_export.py --max-shard-gb 0.5 --work DIR

Writes a run directory once: the model's initial weights as a step-0 DCP checkpoint (weights
only: export reads nothing else) and its run record. Then runs `gridtrain export` in a fresh
process twice, into one file and into files of at most --max-shard-gb, and `gridtrain import` of
each export into a new run (its weights and a fresh AdamW's moments: 12.4 GB of checkpoint). It
reports each process's peak RSS (GNU time's %M: the kernel's high-water mark), the largest
safetensors file, and the RSS of a bare interpreter that has imported torch: what export or
import adds is the difference.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gridtrain.config_load import load_config  # noqa: E402
from gridtrain.layout.dims import ParallelDims  # noqa: E402
from gridtrain.rundir import RunRecord  # noqa: E402
from gridtrain.checkpoint import store as checkpoint  # noqa: E402
from gridtrain.train.build import build_model  # noqa: E402

MODEL = {"model.preset": "small", "model.dim": 1536, "model.n_layers": 24, "model.n_heads": 12,
         "model.n_kv_heads": 12, "model.vocab_size": 32000, "model.ffn_dim": 4096}


def write_run(run_dir: Path) -> int:
    """The run directory with a step-0 checkpoint of the model's weights; returns its parameters."""
    cfg = load_config(None, {**MODEL, "run_dir": str(run_dir)})
    model = build_model(cfg.model.args(), 0, torch.device("cpu"))
    final = checkpoint.step_dir(run_dir / "checkpoints", 0)
    tmp = checkpoint._tmp_dir(final)
    tmp.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(tmp))
    checkpoint._commit(run_dir / "checkpoints", final, 0, keep=1)
    RunRecord(cfg, ParallelDims(1, 1, 1, 1, 1, 1, 1)).write(run_dir)
    return sum(p.numel() for p in model.parameters())


def peak_rss_gb(argv: list[str]) -> tuple[float, float]:
    """(peak RSS of the process in GB, seconds) of one command, by GNU time's %M."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], check=True, capture_output=True, text=True)
    return int(proc.stderr.strip().splitlines()[-1]) * 1024 / 1e9, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gridtrain-bench-export"))
    parser.add_argument("--max-shard-gb", type=float, default=0.5)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    run_dir = args.work / "run"
    params = write_run(run_dir)
    print(f"model: {params / 1e9:.3f}B parameters, {4 * params / 1e9:.2f} GB of fp32 weights")
    bare, _ = peak_rss_gb([sys.executable, "-c", "import torch"])
    print(f"bare interpreter with torch imported: peak RSS {bare:.2f} GB")
    gridtrain = [sys.executable, "-m", "gridtrain"]
    for label, extra in ((f"files of at most {args.max_shard_gb:g} GB", ["--max-shard-gb", str(args.max_shard_gb)]),
                         ("one file", ["--max-shard-gb", "100"])):
        out = args.work / label.replace(" ", "-")
        peak, seconds = peak_rss_gb(gridtrain + ["export", str(run_dir), str(out)] + extra)
        files = list(out.glob("*.safetensors"))
        largest = max(f.stat().st_size for f in files) / 1e9
        print(f"export into {label}: peak RSS {peak:.2f} GB ({peak - bare:.2f} GB above the bare interpreter), "
              f"largest file {largest:.2f} GB, {len(files)} file(s), {seconds:.1f} s")
        imported = args.work / f"imported-{out.name}"
        peak, seconds = peak_rss_gb(gridtrain + ["import", str(out), str(imported)])
        print(f"import from {label}: peak RSS {peak:.2f} GB ({peak - bare:.2f} GB above the bare interpreter, "
              f"{peak - bare - largest:+.2f} GB beside the largest file), {seconds:.1f} s")
        shutil.rmtree(imported)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

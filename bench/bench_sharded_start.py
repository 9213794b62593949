"""Peak memory per rank of starting and training a 0.78B-parameter model (3.1 GB of fp32 weights)
under FSDP 8 on this machine: no rank ever holds the whole model.

    python bench/bench_sharded_start.py                  # 8 processes, 2 steps, seq 32
    python bench/bench_sharded_start.py --nproc 4 --steps 1

Launches the Trainer on --nproc ranks through torchrun (one thread each). Each rank reports its
peak RSS (the kernel's high-water mark, getrusage) after the model is built and after the last
step, the RSS of the bare interpreter with torch imported before anything else, and its model
state bytes. What FSDP asks of a rank is its shard of parameters, gradients and Adam's two
moments: 16 bytes x P / nproc (1.56 GB at 8 ranks); a rank that built the whole model first
would need the 3.1 GB of fp32 weights on top.

The ranks run with MALLOC_MMAP_THRESHOLD_=1048576 (see `launch`) unless --glibc-heap: with glibc's
default, freed temporaries stay in each process's heap and its RSS peaks well above its tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = {"model.preset": "small", "model.dim": 1536, "model.n_layers": 24, "model.n_heads": 12,
         "model.n_kv_heads": 12, "model.vocab_size": 32000, "model.ffn_dim": 4096, "model.tie_embeddings": False}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(out: Path, overrides: dict[str, object]) -> None:
    """One rank (under torchrun): build the Trainer, train, write what it measured."""
    import torch

    bare = peak_rss()
    sys.path.insert(0, str(ROOT))
    from gridtrain.config_load import load_config
    from gridtrain.parallel.accounting import param_bytes
    from gridtrain.train.live_bytes import LiveBytes
    from gridtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    with LiveBytes() as live:
        trainer = Trainer(load_config(None, overrides))
    built, built_tensors = peak_rss(), live.peak
    live.reset_peak()
    with live:
        for _ in range(trainer.cfg.train.steps):
            trainer.train_step()
    rank = trainer.world.rank
    (out / f"rank{rank}.json").write_text(json.dumps({
        "bare": bare, "built": built, "trained": peak_rss(), "params": trainer.num_params,
        "weights_bytes": param_bytes(trainer.pmodel.parameters()), "built_tensors": built_tensors,
        "step_tensors": live.peak}))
    torch.distributed.destroy_process_group()


def launch(nproc: int, steps: int, work: Path, glibc_heap: bool) -> list[dict]:
    corpus = work / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20000)))
    overrides = {**MODEL, "data.corpus": str(corpus), "data.cache_dir": str(work / "cache"), "data.tokenizer": "byte",
                 "data.seq_len": 32, "train.global_batch": nproc, "train.micro_batch": 1, "train.steps": steps, "train.warmup_steps": 0,
                 "train.val_every": 0, "checkpoint.interval": 0, "metrics.tensorboard": False,
                 "metrics.progress": False, "run_dir": str(work / "run"), "parallel.dp_shard": -1,
                 "train.collective_timeout_s": 1800}
    out = work / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(out), json.dumps(overrides)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not glibc_heap:
        # glibc serves large blocks from its heap once a large block has been freed, and keeps
        # freed heap memory: a fixed mmap threshold returns every block of 1 MB or more to the
        # system when it is freed, so the RSS follows the tensors.
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-30000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--glibc-heap", action="store_true",
                        help="leave glibc's allocator as it is (RSS then keeps freed temporaries)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gridtrain-bench-sharded-") as tmp:
        ranks = launch(args.nproc, args.steps, Path(tmp), args.glibc_heap)
    gb = 1e9
    params = ranks[0]["params"]
    print(f"{params / 1e9:.3f}B parameters, {4 * params / gb:.2f} GB of fp32 weights; FSDP {args.nproc}: "
          f"16 x P / {args.nproc} = {16 * params / args.nproc / gb:.2f} GB of model state per rank")
    print("peak RSS (the kernel's) and peak tensor bytes (LiveBytes), per rank:")
    print("rank  bare interpreter  RSS once built  RSS after steps  above bare  weights held  "
          "tensors: built  step")
    for rank, r in enumerate(ranks):
        print(f"{rank:>4}  {r['bare'] / gb:>13.2f} GB  {r['built'] / gb:>11.2f} GB  {r['trained'] / gb:>12.2f} GB  "
              f"{(r['trained'] - r['bare']) / gb:>7.2f} GB  {r['weights_bytes'] / gb:>9.3f} GB  "
              f"{r['built_tensors'] / gb:>11.2f} GB  {r['step_tensors'] / gb:.2f} GB")


if __name__ == "__main__":
    main()

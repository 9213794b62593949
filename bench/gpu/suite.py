"""The GPU measurement as one command: gridtrain's CUDA path checked, timed against torchtitan's
Llama 3 on the same GPU, and set beside the planner's prediction.

    python bench/gpu/suite.py --out DIR                 # on the GPU machine (one H100 or H200)
    python bench/gpu/suite.py --out DIR --cpu-rehearsal # here: every part on tiny shapes, on CPU

Parts, in order, each in its own processes with its own time limit, so one failure costs only
itself; a part that would not fit in what is left of --budget-s is skipped and says so:
  env      the device, torch's version, a bf16 matmul's measured peak (8192^3; 512^3 rehearsing)
  speed    gridtrain (`gridtrain train`) and torchtitan 0.3.0's Llama 3 (titan_side.py) on the
           Llama 3.2 1B shape at seq 8192 and the 3B shape at seq 4096, micro-batch 1, bf16,
           compile off (compile on comes last): median step time, tokens/s, MFU, peak memory
  parity   a 50-step bf16 run of the default model on the device against the same run on CPU,
           within gridtrain.parity.compare's bf16 bounds (reported, with the deviations)
  fp16     20 steps in fp16 with dynamic loss scaling on the device
  tests    the single-process tests (pytest -m 'not dist') with the device selected
  compiled the speed rows again with torch.compile on
  check    `gridtrain plan --check` on each gridtrain speed run
  fp8      FP8 rows (tensorwise and rowwise, eager) of both sides on both shapes
  profile  where gridtrain's 1B eager step spends its device time, by op and kind (profile_step.py)

Everything lands in DIR: <part>.json, one log per process, the gridtrain run directories. The
summary (summarize.py) turns DIR into the README's GPU table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TITAN = Path(__file__).with_name("titan_side.py")

# Llama 3.2 1B and 3B (tied embeddings, RoPE theta 500,000); the rehearsal's stand-ins keep the
# same kinds of choice (GQA, tied head, the FFN given outright) at a size CPU runs in seconds.
SHAPES = {
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab=128256, seq=8192, ac="none"),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab=128256, seq=4096, ac="full"),
}
REHEARSAL = {
    "1b": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab=512, seq=128, ac="none"),
    "3b": dict(dim=192, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=384, vocab=512, seq=64, ac="full"),
}
STEPS, WARMUP = 15, 5


class Suite:
    def __init__(self, out: Path, rehearsal: bool, budget_s: float) -> None:
        self.out, self.rehearsal = out, rehearsal
        self.deadline = time.monotonic() + budget_s
        self.shapes = REHEARSAL if rehearsal else SHAPES
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], limit_s: float, env: dict | None = None) -> dict:
        """Run one process under a time limit; its output goes to <name>.log."""
        limit = min(limit_s, max(1.0, self.left()))
        start = time.monotonic()
        with open(self.out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT,
                                    env=env or self.env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        took = time.monotonic() - start
        print(f"[{time.strftime('%H:%M:%S')}] {name}: rc={rc} in {took:.0f} s (limit {limit:.0f})", flush=True)
        return {"rc": rc, "seconds": round(took, 1)}

    def write(self, part: str, data: object) -> None:
        (self.out / f"{part}.json").write_text(json.dumps(data, indent=1, default=str))

    # -- parts ---------------------------------------------------------------------------------

    def part_env(self) -> None:
        code = ("import json, sys, torch, time\n"
                "from gridtrain.train.device import pick_device, device_name\n"
                "d = pick_device(); n = int(sys.argv[1])\n"
                "a = torch.randn(n, n, device=d, dtype=torch.bfloat16); b = torch.randn(n, n, device=d, dtype=torch.bfloat16)\n"
                "sync = (lambda: torch.accelerator.synchronize()) if d.type != 'cpu' else (lambda: None)\n"
                "for _ in range(3): a @ b\n"
                "sync(); t = time.perf_counter()\n"
                "for _ in range(10): a @ b\n"
                "sync(); s = (time.perf_counter() - t) / 10\n"
                "info = dict(torch=torch.__version__, device=str(d), name=device_name(d), python=sys.version.split()[0],\n"
                "            cuda=torch.version.cuda, matmul_bf16_TFLOPs=2 * n ** 3 / s / 1e12, matmul_n=n)\n"
                "if d.type == 'cuda':\n"
                "    p = torch.cuda.get_device_properties(d); info.update(sms=p.multi_processor_count, memory_GiB=p.total_memory / 2**30)\n"
                "json.dump(info, open(sys.argv[2], 'w'), indent=1)\n")
        n = "512" if self.rehearsal else "8192"
        r = self.run("env", [sys.executable, "-c", code, n, str(self.out / "env.raw.json")], 120)
        info = _load(self.out / "env.raw.json") or {}
        self.write("env", {**info, **r})

    def speed_rows(self, compiled: bool) -> list[dict]:
        rows = []
        for shape, s in self.shapes.items():
            for side in ("gridtrain", "torchtitan"):
                name = f"speed-{side}-{shape}-{'compiled' if compiled else 'eager'}"
                if self.left() < (150 if compiled else 60) and not self.rehearsal:
                    rows.append({"name": name, "skipped": "budget"})
                    continue
                run = self.gridtrain_speed if side == "gridtrain" else self.titan_speed
                rows.append({"name": name, "side": side, "shape": shape, "compile": compiled, **s,
                             **run(name, s, compiled)})
        return rows

    def gridtrain_speed(self, name: str, s: dict, compiled: bool, float8: str = "none") -> dict:
        run_dir = self.out / name
        over = {"run_dir": run_dir, "model.preset": "small", "model.dim": s["dim"], "model.n_layers": s["n_layers"],
                "model.n_heads": s["n_heads"], "model.n_kv_heads": s["n_kv_heads"], "model.ffn_dim": s["ffn_dim"],
                "model.vocab_size": s["vocab"], "model.max_seq_len": s["seq"], "model.tie_embeddings": "true",
                "model.rope_theta": 500000.0, "data.seq_len": s["seq"], "data.cache_dir": self.out / "cache",
                "train.steps": STEPS, "train.global_batch": 1, "train.micro_batch": 1, "train.precision": "bf16",
                "train.recompute": s["ac"], "train.compile": str(compiled).lower(), "train.lr": 8e-4,
                "train.warmup_steps": 2, "train.val_every": 0, "train.sample_tokens": 0,
                "checkpoint.interval": 0, "checkpoint.final": "false", "metrics.log_every": 1,
                "train.float8": float8}
        cmd = [sys.executable, "-m", "gridtrain", "train"] + [a for k, v in over.items() for a in (f"--{k}", str(v))]
        r = self.run(name, cmd, 420 if compiled else 240)
        records = [m for m in _jsonl(run_dir / "metrics.jsonl") if "time/step_s" in m and "memory/weights_bytes" not in m]
        timed = [m for m in records if m["step"] > WARMUP]
        if not timed:
            return r
        step_s = statistics.median(m["time/step_s"] for m in timed)
        last = records[-1]
        return {**r, "step_s": step_s, "tokens_per_s": s["seq"] / step_s,
                "mfu_pct": statistics.median(m["mfu_pct"] for m in timed),
                "peak_allocated_GiB": last.get("memory/peak_GiB"), "peak_reserved_GiB": last.get("memory/reserved_peak_GiB"),
                "loss_first": records[0]["loss/train"], "loss_last": last["loss/train"], "run_dir": str(run_dir)}

    def titan_speed(self, name: str, s: dict, compiled: bool, float8: str = "none") -> dict:
        out = self.out / f"{name}.json"
        cmd = [sys.executable, str(TITAN), "--dim", s["dim"], "--n-layers", s["n_layers"], "--n-heads", s["n_heads"],
               "--n-kv-heads", s["n_kv_heads"], "--ffn-dim", s["ffn_dim"], "--vocab", s["vocab"], "--seq", s["seq"],
               "--micro-batch", 1, "--steps", STEPS, "--warmup", WARMUP, "--ac", s["ac"], "--compile", int(compiled),
               "--precision", "bf16", "--attn", "sdpa", "--flex-autotune", 0, "--float8", float8, "--out", out]
        r = self.run(name, [str(c) for c in cmd], 420 if compiled else 240)
        return {**r, **(_load(out) or {})}

    def part_speed(self) -> None:
        self.write("speed", self.speed_rows(compiled=False))

    def part_compiled(self) -> None:
        self.write("compiled", self.speed_rows(compiled=True))

    def part_fp8(self) -> None:
        """gridtrain's FP8 (torchao's float8 training, real kernels on the GPU) on both shapes,
        eager (validate refuses float8 beside compile until a GPU run compares them)."""
        rows = []
        for shape, s in self.shapes.items():
            for recipe in ("tensorwise", "rowwise"):
                for side in ("gridtrain", "torchtitan"):
                    name = f"fp8-{side}-{shape}-{recipe}"
                    if self.left() < 60 and not self.rehearsal:
                        rows.append({"name": name, "skipped": "budget"})
                        continue
                    run = self.gridtrain_speed if side == "gridtrain" else self.titan_speed
                    rows.append({"name": name, "side": side, "shape": shape, "compile": False, "float8": recipe,
                                 **s, **run(name, s, False, recipe)})
        self.write("fp8", rows)

    def part_parity(self) -> None:
        legs = {}
        for device in ("device", "cpu"):
            env = dict(self.env, CUDA_VISIBLE_DEVICES="") if device == "cpu" else self.env
            cmd = [sys.executable, __file__, "--leg", device, "--out", str(self.out)]
            legs[device] = self.run(f"parity-{device}", cmd + ["--cpu-rehearsal"] * self.rehearsal, 240, env)
        code = ("import json, sys\n"
                "from bench.gpu.legs import compare_legs\n"
                "json.dump(compare_legs(sys.argv[1]), open(sys.argv[2], 'w'), indent=1)\n")
        r = self.run("parity-compare", [sys.executable, "-c", code, str(self.out), str(self.out / "parity.raw.json")], 60)
        self.write("parity", {"legs": legs, "compare": r, **(_load(self.out / "parity.raw.json") or {})})

    def part_fp16(self) -> None:
        run_dir = self.out / "fp16"
        tiny = ["--model.preset", "tiny", "--data.seq_len", "64"] if self.rehearsal else []  # CPU's fp16 is slow
        cmd = [sys.executable, "-m", "gridtrain", "train", *tiny, "--run_dir", str(run_dir), "--train.precision", "fp16",
               "--train.steps", "20", "--train.warmup_steps", "5", "--metrics.log_every", "5", "--data.cache_dir", str(self.out / "cache"),
               "--checkpoint.interval", "0", "--checkpoint.final", "false", "--train.sample_tokens", "0",
               "--train.val_every", "0"]
        r = self.run("fp16", cmd, 180)
        records = [m for m in _jsonl(run_dir / "metrics.jsonl") if "loss/train" in m]
        self.write("fp16", {**r, "losses": [m["loss/train"] for m in records],
                            "loss_scale": [m.get("precision/loss_scale") for m in records]})

    def part_tests(self) -> None:
        r = self.run("tests", [sys.executable, "-m", "pytest", "-m", "not dist", "-q", "-p", "no:cacheprovider",
                               "-x" if self.rehearsal else "-rf"], 180 if self.rehearsal else 200)
        tail = (self.out / "tests.log").read_text().strip().splitlines()[-1:] or [""]
        self.write("tests", {**r, "summary": tail[0]})

    def part_profile(self) -> None:
        """Where gridtrain's 1B eager step spends its time (profile_step.py), beside the speed rows."""
        s, name = self.shapes["1b"], "profile-gridtrain-1b-eager"
        over = {"run_dir": self.out / name, "model.preset": "small", "model.dim": s["dim"],
                "model.n_layers": s["n_layers"], "model.n_heads": s["n_heads"], "model.n_kv_heads": s["n_kv_heads"],
                "model.ffn_dim": s["ffn_dim"], "model.vocab_size": s["vocab"], "model.max_seq_len": s["seq"],
                "model.tie_embeddings": "true", "data.seq_len": s["seq"], "data.cache_dir": self.out / "cache",
                "train.steps": 100, "train.global_batch": 1, "train.micro_batch": 1, "train.precision": "bf16",
                "train.recompute": s["ac"], "train.val_every": 0, "checkpoint.interval": 0,
                "checkpoint.final": "false", "metrics.account_every": 0}
        cmd = [sys.executable, str(Path(__file__).with_name("profile_step.py")), "--out", str(self.out / f"{name}.json")]
        r = self.run(name, cmd + [a for k, v in over.items() for a in (f"--{k}", str(v))], 180)
        self.write("profile", {**r, **(_load(self.out / f"{name}.json") or {})})

    def part_check(self) -> None:
        rows = []
        for run_dir in sorted(p for p in self.out.glob("speed-gridtrain-*") if p.is_dir()):
            r = self.run(f"check-{run_dir.name}", [sys.executable, "-m", "gridtrain", "plan", "--check", str(run_dir)], 60)
            rows.append({"run": run_dir.name, **r})
        self.write("check", rows)


PARTS = ("env", "speed", "parity", "fp16", "tests", "compiled", "check", "fp8", "profile")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-rehearsal", action="store_true", help="every part on tiny shapes, on CPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting parts after this long")
    ap.add_argument("--leg", choices=("device", "cpu"), help=argparse.SUPPRESS)  # parity's worker
    args = ap.parse_args()
    if args.leg:
        sys.path.insert(0, str(ROOT))
        from bench.gpu.legs import run_leg

        run_leg(args.leg, args.out, steps=10 if args.cpu_rehearsal else 50)
        return
    suite = Suite(args.out, args.cpu_rehearsal, args.budget_s)
    for part in args.parts.split(","):
        if suite.left() < 5:
            suite.write(part, {"skipped": "budget"})
            continue
        getattr(suite, f"part_{part}")()


if __name__ == "__main__":
    main()

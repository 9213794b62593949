"""gridtrain's single-process training step against a plain hand-written PyTorch loop.

Both sides do the same work: the same model dimensions, batch, sequence length and precision;
forward, fp32 cross-entropy, backward, gradient clipping at 1.0 and an AdamW step. The plain side
is a self-contained Llama (RMSNorm, RoPE, GQA through SDPA, SwiGLU) written the way a user would
write it in one file, fed with pre-made random tokens; gridtrain's side is `Trainer.train_step`,
which also reads its batch from the token shards, sets the learning rate and gathers metrics.
Steps alternate between the two in rounds so drift in the machine affects both alike.

    python bench/bench_step.py                 # all shapes
    python bench/bench_step.py --shape m26     # the ~26M model in bf16
    python bench/bench_step.py --shape m26 --attention blockwise --chunks 2   # gridtrain's side
        attends by blockwise causal attention (gridtrain.model.blockwise) instead of SDPA

Reports tokens/s of both (median over steps), their ratio, achieved FLOP/s (model FLOPs:
6N + 12 L H Q T per token) and MFU against the peak measured by `gridtrain calibrate`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.config_load import load_config  # noqa: E402
from gridtrain.model.blockwise import blockwise_causal_attention  # noqa: E402
from gridtrain.model.llama import Attention  # noqa: E402
from gridtrain.train.calibrate import cpu_peak_flops  # noqa: E402
from gridtrain.train.trainer import Trainer  # noqa: E402

# name: (model preset, seq_len, micro-batch, precision)
SHAPES = {
    "small": ("small", 256, 8, "fp32"),
    "6l": ("bench-6l", 512, 2, "fp32"),
    "m26": ("m26", 512, 8, "bf16"),
}


class PlainBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int, ffn: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.n1, self.n2 = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.n1(x)
        q = self.wq(h).view(B, T, self.n_heads, self.hd)
        k = self.wk(h).view(B, T, self.n_kv, self.hd)
        v = self.wv(h).view(B, T, self.n_kv, self.hd)
        q, k = rope(q, freqs), rope(k, freqs)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2).type_as(x)


class PlainLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, kv, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(ang), ang), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, self.freqs[: tokens.shape[1]])
        return self.head(self.norm(x))


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, dtype: torch.dtype | None) -> float:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if dtype is None:
        logits = model(inputs)
    else:
        with torch.autocast("cpu", dtype=dtype):
            logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def bench_trainer(name: str, chunks: int = 0) -> Trainer:
    """gridtrain's trainer on a shape, as users run it, with one micro-batch per step; with
    `chunks`, attending by blockwise causal attention in that many chunks."""
    preset, seq, batch, precision = SHAPES[name]
    cfg = load_config(None, {
        "model.preset": preset, "data.seq_len": seq, "train.micro_batch": batch,
        "train.global_batch": batch, "train.precision": precision, "train.steps": 10**6,
        "train.warmup_steps": 10, "train.val_every": 0,
        "run_dir": "/tmp/gridtrain-bench"})
    trainer = Trainer(cfg)
    if chunks:
        for module in trainer.model.modules():
            if isinstance(module, Attention):
                module.core = partial(blockwise_causal_attention, chunks=chunks)
    return trainer


def bench_shape(name: str, rounds: int, steps_per_round: int, warmup: int, chunks: int = 0) -> dict[str, float]:
    _, seq, batch, precision = SHAPES[name]
    trainer = bench_trainer(name, chunks)
    a = trainer.args
    torch.manual_seed(0)
    plain = PlainLlama(a.vocab_size, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim, seq)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, 256, (batch, seq + 1))
    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
    for _ in range(warmup):
        trainer.train_step()
        plain_step(plain, opt, tokens, dtype)
    ours, theirs = [], []
    for _ in range(rounds):
        for _ in range(steps_per_round):
            ours.append(trainer.train_step()["time/step_s"])
        for _ in range(steps_per_round):
            start = time.perf_counter()
            plain_step(plain, opt, tokens, dtype)
            theirs.append(time.perf_counter() - start)
    tokens_per_step = batch * seq
    ours_tps = tokens_per_step / statistics.median(ours)
    plain_tps = tokens_per_step / statistics.median(theirs)
    peak = cpu_peak_flops(precision)
    return {"shape": name, "params_M": trainer.num_params / 1e6, "precision": precision,
            "seq_len": seq, "batch": batch, "gridtrain_tokens_per_s": ours_tps,
            "plain_tokens_per_s": plain_tps, "ratio": ours_tps / plain_tps,
            "gridtrain_GFLOPs": trainer.flops_per_token * ours_tps / 1e9,
            "gridtrain_mfu_pct": 100 * trainer.flops_per_token * ours_tps / peak,
            "plain_mfu_pct": 100 * trainer.flops_per_token * plain_tps / peak,
            "peak_GFLOPs": peak / 1e9, "threads": torch.get_num_threads(),
            "attention": f"blockwise {chunks} chunks" if chunks else "sdpa"}


def profile_breakdown(name: str, chunks: int = 0) -> dict[str, float]:
    """Seconds of one gridtrain step by kind of op (self CPU time): matmuls, attention, the rest.

    Shows where the time goes that MFU does not credit: the attention kernel's share, and the
    achieved FLOP/s of the matmuls alone against the measured peak.
    """
    from torch.profiler import ProfilerActivity, profile

    _, seq, batch, precision = SHAPES[name]
    trainer = bench_trainer(name, chunks)
    for _ in range(3):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step()
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if event.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            kinds["matmul"] += seconds
        elif "scaled_dot_product" in event.key:
            kinds["attention"] += seconds
        else:
            kinds["other"] += seconds
    tokens = batch * seq
    matmul_flops = (trainer.flops_per_token - 12 * trainer.args.n_layers * trainer.args.dim * seq) * tokens  # 6N
    kinds["matmul_GFLOPs"] = matmul_flops / kinds["matmul"] / 1e9
    kinds["peak_GFLOPs"] = cpu_peak_flops(precision) / 1e9
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--attention", choices=["sdpa", "blockwise"], default="sdpa",
                        help="gridtrain's side: torch's causal SDPA or blockwise causal attention")
    parser.add_argument("--chunks", type=int, default=2, help="with --attention blockwise: chunks per sequence")
    parser.add_argument("--profile", action="store_true",
                        help="also split one gridtrain step into matmul, attention and other time")
    args = parser.parse_args()
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    chunks = args.chunks if args.attention == "blockwise" else 0
    results = [bench_shape(n, args.rounds, args.steps, args.warmup, chunks) for n in names]
    print(f"{'shape':<6} {'params':>8} {'prec':<5} {'gridtrain tok/s':>16} {'plain tok/s':>12} "
          f"{'ratio':>6} {'GFLOP/s':>8} {'MFU':>6} {'peak GFLOP/s':>13}")
    for r in results:
        print(f"{r['shape']:<6} {r['params_M']:>7.1f}M {r['precision']:<5} {r['gridtrain_tokens_per_s']:>16,.0f} "
              f"{r['plain_tokens_per_s']:>12,.0f} {r['ratio']:>6.3f} {r['gridtrain_GFLOPs']:>8.1f} "
              f"{r['gridtrain_mfu_pct']:>5.1f}% {r['peak_GFLOPs']:>13.1f}  attention {r['attention']}")
    if args.profile:
        for name in names:
            k = profile_breakdown(name, chunks)
            total = k["matmul"] + k["attention"] + k["other"]
            print(f"{name}: step {total * 1e3:.0f} ms = matmul {k['matmul'] * 1e3:.0f} ms "
                  f"({k['matmul_GFLOPs']:.0f} GFLOP/s, {100 * k['matmul_GFLOPs'] / k['peak_GFLOPs']:.0f}% "
                  f"of peak) + attention {k['attention'] * 1e3:.0f} ms + other {k['other'] * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if any(not math.isfinite(r["ratio"]) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

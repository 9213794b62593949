"""What this CPU's kernels reach at the shapes a model runs them, for `gridtrain plan --gpu local`:
a CPU's kernels run far from one peak, and how far depends on the shape.

- attention: causal SDPA forward + backward by head size and sequence length (a CPU's flash
  kernel skips the blocks above the diagonal, so its rate in full-count FLOPs grows with the
  sequence; at 256 tokens it reaches about 3/4 of its rate at 512 here);
- matmuls: a Llama block's linear layers at width d, each's three GEMMs (forward, input and weight
  gradients) over 1,024 tokens, by d: narrow layers reach less of the peak (75% at d = 64 in bf16
  here, 91% at 512);
- elementwise work: a real transformer block (gridtrain's own, dim 512, sequence 512, 2 sequences)
  run forward and backward, less its matmuls and its attention timed apart at the same shapes and
  less the framework's time per layer, against what the planner's memory-bound model charges for
  the block (plan/steptime.HBM_PASSES passes over its saved activations at the measured
  bandwidth). The ratio is the `hbm` efficiency of this machine's elementwise kernels: norms,
  RoPE, SiLU x gate and autocast's casts, several passes each on a CPU where a GPU fuses them.
Each is measured at shapes other than the ones a plan asks about and interpolated (in log size).
"""

from __future__ import annotations

import time

import torch

from gridtrain.plan import shape as plan_shape
from gridtrain.plan.memory import layer_activation_bytes
from gridtrain.plan.steptime import HBM_PASSES

ATTENTION_HEAD_DIMS = (32, 64, 128)
ATTENTION_SEQS = (128, 256, 512, 1024, 2048)
ATTENTION_TOKENS, ATTENTION_WIDTH = 2048, 512
"""Each attention shape runs 2,048 tokens (batch = 2,048 / sequence) of 512 channels (heads = 512 / head size)."""
ROUNDS = 7
"""Rounds of the elementwise measurement (a difference of three timings: the median round)."""
MATMUL_DIMS = (64, 128, 256, 512, 1024)
MATMUL_TOKENS = 1024
BLOCK = {"dim": 512, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536, "seq": 512, "batch": 2}
"""The block whose elementwise work calibrates the memory-bound rate (not the size of any preset
a plan is checked on, so that a check is not against its own calibration)."""


def best_seconds(fn, seconds: float, at_least: int = 3) -> float:
    """The fastest of repeated calls to `fn` (after one warm-up) over `seconds`, at least `at_least`."""
    fn()
    best, runs, deadline = float("inf"), 0, time.perf_counter() + seconds
    while runs < at_least or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best, runs = min(best, time.perf_counter() - start), runs + 1
    return best


def measure_attention_grid(dtype: torch.dtype, seconds: float) -> dict[str, dict[str, float]]:
    """{head size: {sequence: FLOP/s}} of causal SDPA forward + backward, in the planner's full-count
    FLOPs (3 x 4 s^2 d per head and sequence, no causal halving)."""
    per = seconds / (len(ATTENTION_HEAD_DIMS) * len(ATTENTION_SEQS))
    grid: dict[str, dict[str, float]] = {}
    for d in ATTENTION_HEAD_DIMS:
        for s in ATTENTION_SEQS:
            b, h = max(1, ATTENTION_TOKENS // s), ATTENTION_WIDTH // d
            q, k, v = (torch.randn(b, h, s, d).to(dtype).requires_grad_() for _ in range(3))

            def once() -> None:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            grid.setdefault(str(d), {})[str(s)] = 12 * b * h * s * s * d / best_seconds(once, per)
    return grid


def block_linears(d: int) -> tuple[tuple[int, int], ...]:
    """(in, out) of a Llama block's linear layers at width d: query and output d -> d, keys and
    values d -> d/2 (half as many KV heads), the SwiGLU's d -> 3d twice and 3d -> d."""
    return ((d, d), (d, d // 2), (d, d // 2), (d, d), (d, 3 * d), (d, 3 * d), (3 * d, d))


def measure_matmul_by_dim(dtype: torch.dtype, seconds: float) -> dict[str, float]:
    """{width d: FLOP/s} of a Llama block's linear layers (block_linears) at width d, each's three
    GEMMs (forward, input gradient, weight gradient) over 1,024 tokens."""
    per, out = seconds / len(MATMUL_DIMS), {}
    for d in MATMUL_DIMS:
        layers = [tuple(torch.randn(*s).to(dtype) for s in ((MATMUL_TOKENS, i), (o, i), (MATMUL_TOKENS, o)))
                  for i, o in block_linears(d)]

        def once() -> None:
            for x, w, dy in layers:  # as nn.Linear runs them: x w^T, dy w, dy^T x
                x @ w.t(), dy @ w, dy.t() @ x  # noqa: B018 (timed for their work)

        flops = sum(3 * 2 * MATMUL_TOKENS * i * o for i, o in block_linears(d))
        out[str(d)] = flops / best_seconds(once, per)
    return out


def calibration_block_args():
    from gridtrain.model.args import ModelArgs

    return ModelArgs(dim=BLOCK["dim"], n_layers=1, n_heads=BLOCK["n_heads"], n_kv_heads=BLOCK["n_kv_heads"],
                     vocab_size=32, max_seq_len=BLOCK["seq"], ffn_dim=BLOCK["ffn_dim"])


def block_parts(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the calibration block's forward + backward ('block'), and of its matmuls
    ('matmul': the same GEMMs alone) and its attention ('attention': SDPA forward + backward at its
    shape) timed apart: the round (of ROUNDS) whose difference is the median."""
    from gridtrain.model.llama import TransformerBlock, rope_frequencies

    args = calibration_block_args()
    block, freqs = TransformerBlock(0, args), rope_frequencies(args)
    b, s, d, heads, kv = BLOCK["batch"], BLOCK["seq"], BLOCK["dim"], BLOCK["n_heads"], BLOCK["n_kv_heads"]
    x = torch.randn(b, s, d, requires_grad=True)

    def whole() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = block(x, freqs)
        out.float().sum().backward()

    hd = d // heads
    lin = [tuple(torch.randn(*sh).to(dtype) for sh in ((b * s, i), (o, i), (b * s, o)))
           for i, o in ((d, d), (d, kv * hd), (d, kv * hd), (d, d), (d, BLOCK["ffn_dim"]), (d, BLOCK["ffn_dim"]),
                        (BLOCK["ffn_dim"], d))]
    q = torch.randn(b, heads, s, hd).to(dtype).requires_grad_()
    k, v = (torch.randn(b, kv, s, hd).to(dtype).requires_grad_() for _ in range(2))

    def matmuls() -> None:
        for a, w, dy in lin:
            a @ w.t(), dy @ w, dy.t() @ a  # noqa: B018 (timed for their work)

    def attention() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    # Rounds of the three, each the best of 3 calls, so that a drift of the machine's speed falls on
    # all three alike; the round with the median difference (the elementwise work) is the answer.
    rounds = []
    for _ in range(ROUNDS):
        rounds.append({name: best_seconds(fn, 0.0, at_least=3)
                       for name, fn in (("block", whole), ("matmul", matmuls), ("attention", attention))})
    rounds.sort(key=lambda r: r["block"] - r["matmul"] - r["attention"])
    return rounds[len(rounds) // 2]


def measure_elementwise_share(dtype: torch.dtype, bytes_per_s: float, layer_overhead_s: float) -> float:
    """The fraction of the measured memory bandwidth at which the calibration block's elementwise
    work runs, in the planner's terms (module docstring): the memory-bound model's seconds for the
    block over what the block takes beyond its matmuls, its attention and the framework's time."""
    parts = block_parts(dtype)
    elementwise_s = max(parts["block"] - parts["matmul"] - parts["attention"] - layer_overhead_s, 1e-6)
    act_bytes = 4 if dtype == torch.float32 else 2
    saved = layer_activation_bytes(plan_shape.from_args(calibration_block_args()), BLOCK["seq"], BLOCK["batch"],
                                   act_bytes=act_bytes)
    return min(1.0, HBM_PASSES * saved / bytes_per_s / elementwise_s)


def measure_kernels(modes: list[str], seconds: float, entry: dict) -> dict[str, dict]:
    """The kernel tables of the module docstring for each precision mode, for calibrate's entry
    (which holds the memory bandwidth and the framework's time per layer they are measured against)."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {
        "attention_flops_by_shape": {m: measure_attention_grid(dtypes[m], seconds) for m in modes},
        "matmul_flops_by_dim": {m: measure_matmul_by_dim(dtypes[m], seconds) for m in modes},
        "elementwise_share": {m: measure_elementwise_share(dtypes[m], entry["memory_bytes_per_s"],
                                                           entry["layer_overhead_s"]) for m in modes},
    }

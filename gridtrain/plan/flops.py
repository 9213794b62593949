"""FLOPs: model FLOPs per token (MFU), hardware FLOPs with recomputation (HFU), Megatron's
per-iteration formula, and the roofline.

gridtrain defines MFU once (DESIGN.md): model FLOPs per token = 6N + 12 L H Q T, where N counts
the parameters in matmuls and 12 L H Q T is attention's scores and weighted sum counted in full
(no causal halving; PaLM, Chowdhery et al. 2022, appendix B), divided by the dense peak. With
document masking (data.doc_mask) T in the attention term is the attention span, sum L_i^2 / T over
the sequence's documents: MFU counts the masked FLOPs (documents.py says why).
"""

from __future__ import annotations

from gridtrain.plan.documents import attended
from gridtrain.plan.shape import ModelShape, block_params, matmul_params, moe_block_active_params, norm_params


def flops_per_token(shape: ModelShape, seq_len: int, span: float | None = None) -> float:
    """Model FLOPs per trained token: 6N + 12 L H Q T (equals gridtrain.model.stats.flops_per_token);
    with `span` (documents.py: data.doc_mask's keys per query) 12 L H Q span in place of 12 L H Q T.

    6 = 2 (a multiply-add per parameter, forward) + 4 (input and weight gradients, backward)."""
    keys = attended(seq_len, span)
    return 6 * matmul_params(shape) + 12 * shape.num_layers * shape.num_heads * shape.head_dim * keys


def hardware_flops_per_token(shape: ModelShape, seq_len: int, recompute: str = "none",
                              span: float | None = None) -> float:
    """FLOPs the hardware executes per token, recomputation included (HFU's numerator).

    full: every block's forward runs again, 2 N_blocks + 4 L H Q T more (the head is not
    recomputed: Megatron's 96 = 4 x 24 applies to blocks, the logit layer keeps 3 x; a mixture of
    experts recomputes the experts its tokens pass through, its active parameters);
    attention (Korthikanti et al., Megatron-LM's "selective"): only the attention core, 4 L H Q T
    more; gridtrain's selective saves the matmuls' and attention's outputs and recomputes only
    elementwise work, no FLOPs counted here (parallel/parallelize.py). Flash attention's
    own recomputation of the scores in backward is not counted (it is an implementation detail
    of the kernel, as in Megatron's and torchtitan's accounting). `span`: as flops_per_token's."""
    model = flops_per_token(shape, seq_len, span)
    attention_fwd = 4 * shape.num_layers * shape.num_heads * shape.head_dim * attended(seq_len, span)
    if recompute == "full":
        moe = shape.num_moe_layers
        blocks = ((shape.num_layers - moe) * block_params(shape) + moe * moe_block_active_params(shape)
                  - shape.num_layers * norm_params(shape))
        return model + 2 * blocks + attention_fwd
    if recompute == "attention":
        return model + attention_fwd
    if recompute in ("none", "selective"):
        return model
    raise ValueError(f"recompute must be 'none', 'selective', 'attention' or 'full', not {recompute!r}")


def utilization(tokens_per_s: float, flops_per_token_: float, num_gpus: int, peak_flops: float) -> float:
    """MFU (with model FLOPs per token) or HFU (with hardware FLOPs per token):
    tokens/s x FLOPs/token / (GPUs x peak)."""
    return tokens_per_s * flops_per_token_ / (num_gpus * peak_flops)


def tokens_per_s(mfu: float, flops_per_token_: float, num_gpus: int, peak_flops: float) -> float:
    """Throughput a utilization implies: the inverse of `utilization`."""
    return mfu * num_gpus * peak_flops / flops_per_token_


def megatron_params(num_layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) for a GPT with
    tied embeddings and learned positions (12h^2 + 13h per block, Vh + sh of tables; the final
    LayerNorm's 2h is left out)."""
    l, h = num_layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def megatron_flops_per_iteration(batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int,
                                 recompute: bool = True) -> float:
    """Narayanan et al. 2021, Eq. 3 (hardware FLOPs with full recomputation):
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).

    Without recomputation the blocks cost 3/4 of that, but the logit layer does not change
    (it was never recomputed): F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)). Scaling Eq. 3's whole
    bracket by 72/96, as the reference README's shorthand does, undercounts the logit layer by a
    quarter (6 B s h V is right, 4.5 B s h V is not)."""
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    if recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def achieved_tflops_per_gpu(flops_per_step: float, step_seconds: float, num_gpus: int) -> float:
    return flops_per_step / step_seconds / num_gpus / 1e12


def matmul_intensity(m: int, k: int, n: int, bytes_per_element: int = 2,
                     count_output: bool = False) -> float:
    """Arithmetic intensity of [m x k] @ [k x n]: 2 m k n FLOPs over the bytes moved, by
    default the two inputs only, (m k + k n) x bytes: 2048 FLOPs/byte at m = k = n = 4096 in bf16
    (1365 with the output written)."""
    moved = m * k + k * n + (m * n if count_output else 0)
    return 2 * m * k * n / (moved * bytes_per_element)


def ridge_point(peak_flops: float, hbm_bytes_per_s: float) -> float:
    """Roofline ridge: intensity below which a kernel is memory-bound (Williams et al. 2009; H100: 295 FLOPs/byte)."""
    return peak_flops / hbm_bytes_per_s


def attainable_flops(intensity: float, peak_flops: float, hbm_bytes_per_s: float) -> float:
    """Roofline: min(peak, intensity x memory bandwidth)."""
    return min(peak_flops, intensity * hbm_bytes_per_s)


def effective_mfu(mfu: float, compute_s: float, exposed_comm_s: float) -> float:
    """MFU once exposed communication lengthens the step: mfu x compute / (compute + comm).
    Worked example: 50% x 242 / (242 + 350) = 20%."""
    return mfu * compute_s / (compute_s + exposed_comm_s)

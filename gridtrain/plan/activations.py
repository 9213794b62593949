"""Bytes a rank of a gridtrain run saves for backward, as the runtime saves them.

Measured tensor by tensor with saved-tensor hooks (parallel/accounting.py; selective
checkpointing's own cache included) on gridtrain's Llama block, then fitted exactly over seven
shapes: per token of a micro-batch and per block, bytes = c_h h + c_q q + c_kv kv_width + c_F F
+ c_a a + c_1 (h the width, q = a x head_dim the Q width, equal to h unless the heads are wider
(Qwen3), kv_width the K and V width, F the SwiGLU width, a the query heads). Under
tensor parallelism over t ranks each coefficient splits into a part every rank holds in full
("replicated": the gathered matmul inputs, the partial sums a row-parallel matmul writes), a part
sequence parallelism splits by t ("sequence": the residual stream, the norms' inputs and their
rsqrt), and a part split by t ("heads": Q, K, V, the attention output and its log-sum-exp,
SwiGLU's four F-wide tensors). Fitted at t = 1 and t = 2, with and without SP, all exact:

| precision | recompute | replicated | sequence | heads |
|---|---|---|---|---|
| fp32 | none | 8h | 16h + 8 | 8q + 8kv + 16F + 4a |
| fp32 | selective | 8h | 4h | 8q + 8kv + 8F + 4a |
| fp32 | full | | 4h | |
| bf16/fp16 | none | 10h | 16h + 8 | 4q + 4kv + 8F + 4a |
| bf16/fp16 | selective | 4h | 4h | 4q + 4kv + 4F + 4a |
| bf16/fp16 | full | | 4h | |

QK-norm (Qwen3; fitted the same way over head widths, both precisions) adds, without
recomputation, what its two RMSNorms save in fp32 over each head: their inputs and normalised
outputs, 8q + 8kv, and their rsqrt, 4 bytes a query or KV head, 4a + 4k (heads, split by t);
recomputation, selective or full, keeps none of it (the policy saves no norm). Under FSDP each
also keeps its weight's fp32 copy, 4 head_dim a forward, as the block's norms do.
Selective recomputation keeps what its policy saves (every matmul's and attention's output) and
the block input; full keeps the block input alone (the residual stream is fp32 in every mode).
Under bf16/fp16 autocast without FSDP, each matmul weight's 16-bit cast is saved too, once per
autocast region: per micro-batch without a pipeline, once per step with one (the schedule runs in
one region); FSDP gathers the weights in 16 bits already, and recomputation recasts them.
The last stage adds, per token, the final norm's input and normalised input (8h, split by SP),
its rsqrt (4, split by SP), the head's input (4h fp32, 2h in 16 bits, whole under SP), the fp32
log-probabilities (4V/t) and the loss (4 bytes a micro-batch); with 16 bits, the head weight's cast.
Token ids (8 bytes each) are kept by the embedding and the targets by the loss.

A mixture-of-experts block (model/moe.py; measured the same way over eight shapes of experts E,
top-k, expert width F_e, shared experts S and h, all exact to the per-micro-batch constants) keeps
the attention's part of the census above (its F terms dropped) and, in place of the SwiGLU, per
token: for each of its k assignments the rows it dispatches, its expert's three outputs and the
combine's input (12h fp32, 6h in 16 bits), the expert's four F_e-wide tensors (16 F_e, 8 F_e) and
its indices and gate (28 bytes, 26 in 16 bits; 4 more each with renormalised gates); the router's
fp32 scores (4E), the renormaliser's sum (4), the z-loss's logits and log-sum-exp (4E + 4); shared
experts as a dense SwiGLU of S F_e (16 S F_e fp32; 8 S F_e and the two input casts, 4h, in 16 bits); with the auxiliary loss on sigmoid
scores, each token's score sum (4). Once per forward: the grouped matmul's offsets (4E) and the
auxiliary loss's score sums and token count (4E + 4).
Selective recomputation keeps the router's logits (4E) and what the shared experts' matmuls write
(8 S F_e + 4h, 4 S F_e + 2h in 16 bits) and loses the dense MLP's output (4h, 2h); the grouped
matmul is not among the ops it saves (the loop's matmuls are: k (8 F_e + 4h), k (4 F_e + 2h)).
The whole mixture runs on every tensor-parallel rank (parallel/tensor_parallel.moe_plan), so its
part is not split by t. Under 16-bit autocast the router's weight is copied to fp32 (4 E h) and
the experts cast (6 E h F_e) by hand in every forward, unless FSDP gathered them in 16 bits.
"""

from __future__ import annotations

import functools

from gridtrain.plan.shape import ModelShape

# (replicated, sequence, heads), each a row of coefficients of (h, kv_width, F, a, 1); in the heads
# row the first is of q, the Q width (h unless the heads are wider).
COEFFICIENTS: dict[tuple[str, str], tuple[tuple[int, ...], ...]] = {
    ("fp32", "none"): ((8, 0, 0, 0, 0), (16, 0, 0, 0, 8), (8, 8, 16, 4, 0)),
    ("fp32", "selective"): ((8, 0, 0, 0, 0), (4, 0, 0, 0, 0), (8, 8, 8, 4, 0)),
    ("fp32", "full"): ((0, 0, 0, 0, 0), (4, 0, 0, 0, 0), (0, 0, 0, 0, 0)),
    ("16bit", "none"): ((10, 0, 0, 0, 0), (16, 0, 0, 0, 8), (4, 4, 8, 4, 0)),
    ("16bit", "selective"): ((4, 0, 0, 0, 0), (4, 0, 0, 0, 0), (4, 4, 4, 4, 0)),
    ("16bit", "full"): ((0, 0, 0, 0, 0), (4, 0, 0, 0, 0), (0, 0, 0, 0, 0)),
}


def _class(precision: str) -> str:
    return "fp32" if precision == "fp32" else "16bit"


def moe_ffn_bytes_per_token(shape: ModelShape, precision: str, recompute: str, ep: int = 1,
                            imbalance: float = 1.0) -> float:
    """What an MoE block saves per token beyond the attention's part of the census (module
    docstring), on every tensor-parallel rank alike. Under expert parallelism (ep > 1) each row a
    rank receives adds an int64 index and one h-wide tensor of the compute dtype (the arrival
    order's regrouping; measured by dry runs), and the routed terms are scaled by `imbalance`,
    the rows the rank receives over its own assignments (1: their expectation)."""
    h, e, k, f, shared = shape.hidden, shape.num_experts, shape.top_k, shape.expert_ffn, shape.num_shared_experts
    wide = 4 if _class(precision) == "fp32" else 2
    if recompute == "full":
        return 0.0
    if recompute == "selective":
        loop = 0 if shape.moe_grouped else k * (2 * wide * f + wide * h)
        return -wide * h + 4 * e + (2 * wide * shared * f + wide * h if shared else 0) + loop * imbalance
    norm = 4 if shape.moe_normalize else 0
    received = wide * h + 8 if ep > 1 else 0
    routed = k * (3 * wide * h + 4 * wide * f + (28 if wide == 4 else 26) + norm + received) * imbalance
    router = 4 * e + norm + (4 * e + 4 if shape.router_z_loss else 0)
    router += 4 if shape.router_aux_loss and shape.router_sigmoid else 0  # the per-token normaliser
    experts_shared = (16 * shared * f if wide == 4 else 8 * shared * f + 4 * h) if shared else 0
    return routed + router + experts_shared


def qk_norm_bytes_per_token(shape: ModelShape, recompute: str) -> int:
    """What QK-norm saves per token and block before TP's split by heads (module docstring): the
    two head norms' fp32 inputs and outputs (8q + 8kv) and an rsqrt a head (4a + 4k), in either
    precision; nothing under recomputation."""
    if not shape.qk_norm or recompute != "none":
        return 0
    return 8 * (shape.q_width + shape.kv_width) + 4 * (shape.num_heads + shape.num_kv_heads)


@functools.lru_cache(maxsize=4096)
def block_bytes_per_token(shape: ModelShape, precision: str, recompute: str, tp: int = 1,
                          sequence_parallel: bool = False, moe: bool = False, ep: int = 1,
                          imbalance: float = 1.0) -> float:
    """Bytes one block saves per token of a micro-batch on one tensor-parallel rank (with
    `moe`, a mixture-of-experts block)."""
    rest = (shape.kv_width, 0 if moe else shape.ffn, shape.num_heads, 1)
    replicated, sequence, heads = (sum(c * x for c, x in zip(row, (width,) + rest))
                                   for row, width in zip(COEFFICIENTS[(_class(precision), recompute)],
                                                         (shape.hidden, shape.hidden, shape.q_width)))
    heads += qk_norm_bytes_per_token(shape, recompute)
    dense = replicated + sequence / (tp if sequence_parallel else 1) + heads / tp
    return dense + (moe_ffn_bytes_per_token(shape, precision, recompute, ep, imbalance) if moe else 0.0)


def ring_selective_bytes_per_token(shape: ModelShape, precision: str, recompute: str, tp: int, cp: int,
                                   cp_rank: int) -> float:
    """What selective recomputation keeps of ring attention beyond the census, per local token and
    block: its policy saves every fused-kernel output, and the ring calls the kernel once per block
    of query and key chunks, (cp + cp_rank + 2) chunk-rows of output and log-sum-exp for the rank's
    2 chunks (parallel/context_parallel.py: query chunk r sees r earlier chunks and its own, chunk
    2cp-1-r one run of chunks per other rank, and its own pair as two), where SDPA's one call keeps
    one: (cp + cp_rank) / 2 outputs (q wide, in the training dtype; 1/tp of the heads) and
    log-sum-exps (one fp32 per query head) more."""
    if cp == 1 or recompute != "selective":
        return 0.0
    out = (4 if precision == "fp32" else 2) * shape.q_width + 4 * shape.num_heads
    return (cp + cp_rank) / 2 * out / tp


def head_bytes_per_token(shape: ModelShape, precision: str, tp: int = 1, sequence_parallel: bool = False) -> float:
    """The last stage's final norm, head input and fp32 log-probabilities, per token (the loss's
    4 bytes a micro-batch aside)."""
    sp = tp if sequence_parallel else 1
    head_input = (4 if precision == "fp32" else 2) * shape.hidden
    return (8 * shape.hidden + 4) / sp + head_input + 4 * shape.vocab / tp


def moe_forward_bytes(shape: ModelShape, recompute: str, ep: int = 1) -> float:
    """What an MoE block saves once per forward, whatever its tokens: the grouped matmul's int32
    offsets (4 per expert of the rank) and the auxiliary loss's score sums and token count (4E + 4)."""
    if recompute != "none":
        return 0.0
    e = shape.num_experts
    return 4 * e // ep * shape.moe_grouped + (4 * e + 4) * shape.router_aux_loss


def weight_cast_bytes(shape: ModelShape, layers: int, last: bool, tp: int = 1, moe_layers: int = 0) -> float:
    """16-bit casts of a stage's matmul weights (autocast without FSDP): each block's attention
    and MLP matrices and, on the last stage, the head, 1/t of each on a tensor-parallel rank; an
    MoE block's shared experts (whole on every rank), its router and routed experts being cast by
    hand instead (moe_cast_bytes)."""
    h, kv = shape.hidden, shape.kv_width
    attention = 2 * h * shape.num_heads * shape.head_dim + 2 * h * kv
    dense = (layers - moe_layers) * (attention + 3 * h * shape.ffn) + moe_layers * attention
    shared = moe_layers * 3 * h * shape.num_shared_experts * shape.expert_ffn
    return 2 * (dense + (shape.vocab * h if last else 0)) / tp + 2 * shared


def moe_cast_bytes(shape: ModelShape, moe_layers: int, fsdp: bool, ep: int) -> float:
    """What an MoE block's forward copies by hand under 16-bit autocast (model/moe.py) and saves:
    the router's weight in fp32 (4 E h), and the rank's E / ep routed experts in 16 bits (2 x 3 E
    h F_e / ep) unless FSDP gathered them so (experts outside FSDP under expert parallelism)."""
    h, f = shape.hidden, shape.expert_ffn
    experts = 0 if fsdp and ep == 1 else 6 * shape.num_experts // ep * h * f
    return moe_layers * (4 * shape.num_experts * h + experts)


def stage_bytes(shape: ModelShape, layers: int, last: bool, tokens: int, precision: str, recompute: str,
                tp: int = 1, sequence_parallel: bool = False, moe_layers: int = 0, ep: int = 1,
                imbalance: float = 1.0) -> float:
    """One forward of one micro-batch of `tokens` tokens through a stage of `layers` blocks, of
    which `moe_layers` have a mixture of experts (and the head when `last`), without token ids
    and weight casts."""
    dense = block_bytes_per_token(shape, precision, recompute, tp, sequence_parallel)
    moe = block_bytes_per_token(shape, precision, recompute, tp, sequence_parallel, True, ep,
                                imbalance) if moe_layers else 0.0
    out = tokens * ((layers - moe_layers) * dense + moe_layers * moe)
    if moe_layers:
        out += moe_layers * moe_forward_bytes(shape, recompute, ep)
    if last:
        out += tokens * head_bytes_per_token(shape, precision, tp, sequence_parallel) + 4
    return out


def forward_extras(shape: ModelShape, layers: int, last: bool, precision: str, recompute: str, tp: int,
                   fsdp: bool, moe_layers: int = 0, ep: int = 1) -> tuple[float, float]:
    """What a stage saves beyond its tokens' activations: (once per autocast region, once per
    forward). Without FSDP, bf16/fp16 autocast's weight casts (recomputed blocks recast them in
    backward instead). With FSDP the weights arrive in 16 bits and RMSNorm, which computes in
    fp32, saves an fp32 copy of its weight (4h bytes; QK-norm's two, 4 head_dim) per norm and forward. MoE blocks copy their
    router and experts by hand in every forward (moe_cast_bytes)."""
    if precision == "fp32":
        return 0.0, 0.0
    blocks = layers if recompute == "none" else 0
    moe = moe_layers if recompute == "none" else 0
    by_hand = moe_cast_bytes(shape, moe, fsdp, ep) if moe else 0.0
    if fsdp:
        qk_norms = 8.0 * shape.head_dim * blocks if shape.qk_norm else 0.0
        return 0.0, 4.0 * shape.hidden * (2 * blocks + last) + qk_norms + by_hand
    return weight_cast_bytes(shape, blocks, last, tp, moe), by_hand


def stage_moe_layers(shape: ModelShape, stage_layers: list[int] | tuple[int, ...]) -> list[int]:
    """MoE layers in each stage of a split of the blocks into consecutive stages."""
    out, start = [], 0
    for n in stage_layers:
        out.append(shape.moe_layers_in(start, start + n))
        start += n
    return out


def held_bytes(shape: ModelShape, held: dict[int, int], stage_layers: list[int], tokens: int, precision: str,
               recompute: str, tp: int = 1, sequence_parallel: bool = False, fsdp: bool = False,
               ep: int = 1, imbalance: float = 1.0) -> float:
    """Activations of `held[s]` forwards of each stage s (stage_layers[s] blocks; the last stage
    has the head), with their extras; token ids aside. Under expert parallelism the routed rows
    a rank receives are `imbalance` times its own assignments (1: their expectation)."""
    last_stage = len(stage_layers) - 1
    moe = stage_moe_layers(shape, stage_layers) if shape.num_experts else None  # a dense search skips the walk
    total = 0.0
    for stage, count in held.items():
        last, n = stage == last_stage, stage_layers[stage]
        k = moe[stage] if moe else 0
        per_region, per_forward = forward_extras(shape, n, last, precision, recompute, tp, fsdp, k, ep)
        forward = stage_bytes(shape, n, last, tokens, precision, recompute, tp, sequence_parallel, k, ep, imbalance)
        total += count * (forward + per_forward) + (per_region if count else 0.0)
    return total

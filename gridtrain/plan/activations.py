"""Bytes a rank of a gridtrain run saves for backward, as the runtime saves them.

Measured tensor by tensor with saved-tensor hooks (parallel/accounting.py; selective
checkpointing's own cache included) on gridtrain's Llama block, then fitted exactly over seven
shapes: per token of a micro-batch and per block, bytes = c_h h + c_kv kv_width + c_F F + c_a a
+ c_1 (h the width, kv_width the K and V width, F the SwiGLU width, a the query heads). Under
tensor parallelism over t ranks each coefficient splits into a part every rank holds in full
("replicated": the gathered matmul inputs, the partial sums a row-parallel matmul writes), a part
sequence parallelism splits by t ("sequence": the residual stream, the norms' inputs and their
rsqrt), and a part split by t ("heads": Q, K, V, the attention output and its log-sum-exp,
SwiGLU's four F-wide tensors). Fitted at t = 1 and t = 2, with and without SP, all exact:

| precision | recompute | replicated | sequence | heads |
|---|---|---|---|---|
| fp32 | none | 8h | 16h + 8 | 8h + 8kv + 16F + 4a |
| fp32 | selective | 8h | 4h | 8h + 8kv + 8F + 4a |
| fp32 | full | | 4h | |
| bf16/fp16 | none | 10h | 16h + 8 | 4h + 4kv + 8F + 4a |
| bf16/fp16 | selective | 4h | 4h | 4h + 4kv + 4F + 4a |
| bf16/fp16 | full | | 4h | |

Selective recomputation keeps what its policy saves (every matmul's and attention's output) and
the block input; full keeps the block input alone (the residual stream is fp32 in every mode).
Under bf16/fp16 autocast without FSDP, each matmul weight's 16-bit cast is saved too, once per
autocast region: per micro-batch without a pipeline, once per step with one (the schedule runs in
one region); FSDP gathers the weights in 16 bits already, and recomputation recasts them.
The last stage adds, per token, the final norm's input and normalised input (8h, split by SP),
its rsqrt (4, split by SP), the head's input (4h fp32, 2h in 16 bits, whole under SP), the fp32
log-probabilities (4V/t) and the loss (4 bytes a micro-batch); with 16 bits, the head weight's cast.
Token ids (8 bytes each) are kept by the embedding and the targets by the loss.
"""

from __future__ import annotations

import functools

from gridtrain.plan.shape import ModelShape

# (replicated, sequence, heads), each a row of coefficients of (h, kv_width, F, a, 1).
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


@functools.lru_cache(maxsize=4096)
def block_bytes_per_token(shape: ModelShape, precision: str, recompute: str, tp: int = 1,
                          sequence_parallel: bool = False) -> float:
    """Bytes one block saves per token of a micro-batch on one tensor-parallel rank."""
    terms = (shape.hidden, shape.kv_width, shape.ffn, shape.num_heads, 1)
    replicated, sequence, heads = (sum(c * x for c, x in zip(row, terms))
                                   for row in COEFFICIENTS[(_class(precision), recompute)])
    return replicated + sequence / (tp if sequence_parallel else 1) + heads / tp


def ring_selective_bytes_per_token(shape: ModelShape, precision: str, recompute: str, tp: int, cp: int,
                                   cp_rank: int) -> float:
    """What selective recomputation keeps of ring attention beyond the census, per local token and
    block: its policy saves every fused-kernel output, and the ring calls the kernel once per block
    of query and key chunks, (cp + cp_rank + 2) chunk-rows of output and log-sum-exp for the rank's
    2 chunks (parallel/context_parallel.py: query chunk r sees r earlier chunks and its own, chunk
    2cp-1-r one run of chunks per other rank, and its own pair as two), where SDPA's one call keeps
    one: (cp + cp_rank) / 2 outputs (h wide, in the training dtype; 1/tp of the heads) and
    log-sum-exps (one fp32 per query head) more."""
    if cp == 1 or recompute != "selective":
        return 0.0
    out = (4 if precision == "fp32" else 2) * shape.hidden + 4 * shape.num_heads
    return (cp + cp_rank) / 2 * out / tp


def head_bytes_per_token(shape: ModelShape, precision: str, tp: int = 1, sequence_parallel: bool = False) -> float:
    """The last stage's final norm, head input and fp32 log-probabilities, per token (the loss's
    4 bytes a micro-batch aside)."""
    sp = tp if sequence_parallel else 1
    head_input = (4 if precision == "fp32" else 2) * shape.hidden
    return (8 * shape.hidden + 4) / sp + head_input + 4 * shape.vocab / tp


def weight_cast_bytes(shape: ModelShape, layers: int, last: bool, tp: int = 1) -> float:
    """16-bit casts of a stage's matmul weights (autocast without FSDP): each block's attention
    and MLP matrices and, on the last stage, the head, 1/t of each on a tensor-parallel rank."""
    h, kv = shape.hidden, shape.kv_width
    block = 2 * h * shape.num_heads * shape.head_dim + 2 * h * kv + 3 * h * shape.ffn
    return 2 * (layers * block + (shape.vocab * h if last else 0)) / tp


def stage_bytes(shape: ModelShape, layers: int, last: bool, tokens: int, precision: str, recompute: str,
                tp: int = 1, sequence_parallel: bool = False) -> float:
    """One forward of one micro-batch of `tokens` tokens through a stage of `layers` blocks (and
    the head when `last`), without token ids and weight casts."""
    out = tokens * layers * block_bytes_per_token(shape, precision, recompute, tp, sequence_parallel)
    if last:
        out += tokens * head_bytes_per_token(shape, precision, tp, sequence_parallel) + 4
    return out


def forward_extras(shape: ModelShape, layers: int, last: bool, precision: str, recompute: str, tp: int,
                   fsdp: bool) -> tuple[float, float]:
    """What a stage saves beyond its tokens' activations: (once per autocast region, once per
    forward). Without FSDP, bf16/fp16 autocast's weight casts (recomputed blocks recast them in
    backward instead). With FSDP the weights arrive in 16 bits and RMSNorm, which computes in
    fp32, saves an fp32 copy of its weight (4h bytes) per norm and forward."""
    if precision == "fp32":
        return 0.0, 0.0
    blocks = layers if recompute == "none" else 0
    if fsdp:
        return 0.0, 4.0 * shape.hidden * (2 * blocks + last)
    return weight_cast_bytes(shape, blocks, last, tp), 0.0


def held_bytes(shape: ModelShape, held: dict[int, int], stage_layers: list[int], tokens: int, precision: str,
               recompute: str, tp: int = 1, sequence_parallel: bool = False, fsdp: bool = False) -> float:
    """Activations of `held[s]` forwards of each stage s (stage_layers[s] blocks; the last stage
    has the head), with their extras; token ids aside."""
    last_stage = len(stage_layers) - 1
    total = 0.0
    for stage, count in held.items():
        last = stage == last_stage
        per_region, per_forward = forward_extras(shape, stage_layers[stage], last, precision, recompute, tp, fsdp)
        forward = stage_bytes(shape, stage_layers[stage], last, tokens, precision, recompute, tp, sequence_parallel)
        total += count * (forward + per_forward) + (per_region if count else 0.0)
    return total

"""The shape of a model as the planner sees it: sizes only, no weights, no torch.

One `ModelShape` covers both block families the planner meets:
- Llama blocks (gridtrain's model): RMSNorm, grouped-query attention without biases, SwiGLU MLP
  with three matrices of width `ffn`, rotary positions (no position table); optionally heads of an
  explicit width and QK-norm (Qwen3), and mixture-of-experts feed-forwards on some layers (a
  router, `num_experts` stacked SwiGLU experts of width `expert_ffn` of which each token uses
  `top_k`, and `num_shared_experts` every token passes through);
- GPT blocks (most published runs, e.g. Megatron's SC21 table): LayerNorm with bias, multi-head
  attention and a GELU MLP of width `ffn` (4h) with biases, learned positions, tied embeddings.
Parameter counts are exact for both and equal gridtrain.model.stats.count_parameters for Llama.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gridtrain.model.args import ModelArgs, ParamCounts


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    """Width of the residual stream (h)."""
    num_layers: int
    """Transformer blocks (l or L)."""
    num_heads: int
    """Query heads (a)."""
    num_kv_heads: int
    """Key/value heads (equal to num_heads without grouped-query attention)."""
    ffn: int
    """Hidden width of the MLP (SwiGLU: each of its three matrices; GPT: 4h)."""
    vocab: int
    """Rows of the embedding and the output head (V)."""
    block: str = "llama"
    """'llama' (RMSNorm, GQA, SwiGLU, no biases) or 'gpt' (LayerNorm, GELU MLP, biases)."""
    tie_embeddings: bool = False
    """The output head shares the embedding matrix."""
    max_positions: int = 0
    """Rows of a learned position table (GPT; 0 for rotary positions)."""
    explicit_head_dim: int = 0
    """Width of each attention head where it is not hidden / num_heads (Qwen3); 0: hidden / num_heads."""
    qk_norm: bool = False
    """An RMSNorm weight of head_dim over each head's queries and one over its keys (Qwen3)."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (E); 0: a dense model."""
    top_k: int = 0
    """Routed experts each token passes through (k)."""
    expert_ffn: int = 0
    """Hidden width of each routed (and shared) expert's SwiGLU."""
    num_shared_experts: int = 0
    """Experts every token passes through, one SwiGLU of num_shared_experts x expert_ffn."""
    moe_every: int = 1
    """An MoE feed-forward on every n-th layer from moe_first_dense on (MoEArgs.every)."""
    moe_first_dense: int = 0
    """The first layers that stay dense (MoEArgs.first_dense)."""
    moe_normalize: bool = True
    """The top-k gate values are renormalised (MoEArgs.normalize_top_k): what the router saves."""
    router_z_loss: bool = False
    """The router z-loss is on (what the router saves)."""
    moe_grouped: bool = True
    """The experts run through one grouped matmul, not a loop (what selective recomputation keeps)."""
    router_aux_loss: bool = False
    """The auxiliary balance loss is on (what the router saves)."""
    router_sigmoid: bool = False
    """Sigmoid scores, not softmax (what the auxiliary loss saves)."""
    capacity_factor: float | None = None
    """Each expert keeps at most capacity_factor x its even share of a micro-batch's assignments
    in training (MoEArgs.capacity_factor); None: dropless."""

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of Q (and of the attention output): num_heads x head_dim."""
        return self.num_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a mixture-of-experts feed-forward (MoEArgs.is_moe_layer)."""
        return (self.num_experts > 0 and layer >= self.moe_first_dense
                and (layer - self.moe_first_dense) % self.moe_every == 0)

    def moe_layers_in(self, start: int, stop: int) -> int:
        """MoE layers among blocks start..stop-1 (in constant time: a stage of a 10,000-layer model)."""
        first = max(start, self.moe_first_dense)
        if self.num_experts == 0 or first >= stop:
            return 0
        # MoE layers in [first_dense, i): ceil((i - first_dense) / every).
        before_stop, before_first = (-(-(i - self.moe_first_dense) // self.moe_every) for i in (stop, first))
        return before_stop - before_first

    @property
    def num_moe_layers(self) -> int:
        return self.moe_layers_in(0, self.num_layers)

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): num_kv_heads x head_dim."""
        return self.num_kv_heads * self.head_dim


def from_args(args: ModelArgs) -> ModelShape:
    """The shape of a gridtrain model (a preset or `model.*` keys), mixtures of experts included."""
    moe = args.moe
    experts = {} if moe is None else dict(
        num_experts=moe.num_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn_dim,
        num_shared_experts=moe.num_shared_experts, moe_every=moe.every, moe_first_dense=moe.first_dense,
        moe_normalize=moe.normalize_top_k, router_z_loss=moe.z_loss_coef > 0, moe_grouped=moe.grouped_mm,
        router_aux_loss=moe.balance == "aux_loss" and moe.aux_loss_coef > 0, router_sigmoid=moe.score == "sigmoid",
        capacity_factor=moe.capacity_factor)
    return ModelShape(hidden=args.dim, num_layers=args.n_layers, num_heads=args.n_heads,
                      num_kv_heads=args.n_kv_heads or args.n_heads, ffn=args.hidden_dim,
                      vocab=args.vocab_size, block="llama", tie_embeddings=args.tie_embeddings,
                      explicit_head_dim=args.explicit_head_dim or 0, qk_norm=args.qk_norm, **experts)


def gpt(hidden: int, num_layers: int, num_heads: int, vocab: int = 51_200, seq_len: int = 2048,
        ffn: int | None = None) -> ModelShape:
    """A GPT block stack as in Megatron-LM (Narayanan et al. 2021): ffn = 4h, tied embeddings,
    learned positions for `seq_len`."""
    return ModelShape(hidden=hidden, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_heads, ffn=ffn or 4 * hidden, vocab=vocab, block="gpt",
                      tie_embeddings=True, max_positions=seq_len)


def with_layers(shape: ModelShape, num_layers: int) -> ModelShape:
    return replace(shape, num_layers=num_layers)


def attention_params(shape: ModelShape) -> int:
    """One block's attention: Wq (h x q_width), Wk and Wv (h x kv_width each), Wo (q_width x h),
    q_width = h unless the heads are wider (Qwen3), and QK-norm's two head_dim weights.

    Llama: 2h^2 + 2 h kv_width (GQA, Ainslie et al. 2023; the 4h^2 often quoted assumes full multi-head).
    GPT adds biases: 3h for QKV and h for the output projection (4h^2 + 4h)."""
    h = shape.hidden
    weights = 2 * h * shape.q_width + 2 * h * shape.kv_width + (2 * shape.head_dim if shape.qk_norm else 0)
    return weights + (2 * h + 2 * shape.kv_width if shape.block == "gpt" else 0)


def mlp_params(shape: ModelShape) -> int:
    """One block's MLP. SwiGLU: three h x ffn matrices (3 h ffn). GPT: two, with biases
    (2 h ffn + ffn + h; 8h^2 + 5h at ffn = 4h)."""
    h, f = shape.hidden, shape.ffn
    if shape.block == "gpt":
        return 2 * h * f + f + h
    return 3 * h * f


def norm_params(shape: ModelShape) -> int:
    """Norms of one block: two RMSNorm weights (2h) or two LayerNorms with bias (4h)."""
    return 4 * shape.hidden if shape.block == "gpt" else 2 * shape.hidden


def moe_mlp_params(shape: ModelShape) -> int:
    """What every token uses of an MoE layer's feed-forward: the router (E x h) and the shared
    experts (3 h x num_shared_experts x expert_ffn); gridtrain's stats count them under mlp."""
    return shape.num_experts * shape.hidden + 3 * shape.hidden * shape.num_shared_experts * shape.expert_ffn


def expert_params(shape: ModelShape) -> int:
    """The routed experts of one MoE layer: E SwiGLUs of width expert_ffn, 3 E h expert_ffn."""
    return 3 * shape.num_experts * shape.hidden * shape.expert_ffn


def block_params(shape: ModelShape) -> int:
    """Parameters of one dense transformer block. GPT: 12h^2 + 13h (Megatron, Narayanan et al. Eq. 2)."""
    return attention_params(shape) + mlp_params(shape) + norm_params(shape)


def moe_block_active_params(shape: ModelShape) -> int:
    """Parameters of an MoE block one token passes through: attention, norms, router, shared
    experts and its top_k routed experts."""
    routed = 3 * shape.top_k * shape.hidden * shape.expert_ffn
    return attention_params(shape) + moe_mlp_params(shape) + routed + norm_params(shape)


def param_counts(shape: ModelShape) -> ParamCounts:
    """Every parameter by part; a tied head counts once, under the embedding (as gridtrain's
    stats do). The final norm counts under norms; a learned position table under embedding.
    MoE layers put their router and shared experts under mlp, their routed experts under
    experts, and a token's top_k of them under experts_active (gridtrain.model.stats)."""
    h, l = shape.hidden, shape.num_layers
    moe = shape.num_moe_layers
    final_norm = norm_params(shape) // 2
    return ParamCounts(
        embedding=shape.vocab * h + shape.max_positions * h,
        attention=l * attention_params(shape),
        mlp=(l - moe) * mlp_params(shape) + moe * moe_mlp_params(shape),
        norms=l * norm_params(shape) + final_norm,
        output=0 if shape.tie_embeddings else shape.vocab * h,
        experts=moe * expert_params(shape),
        experts_active=moe * 3 * shape.top_k * h * shape.expert_ffn,
    )


def matmul_params(shape: ModelShape) -> int:
    """N of the 6N rule: parameters that take part in matmuls. The input embedding is a lookup
    and does not count, nor does a learned position table, unless the embedding is tied to the
    head, whose matmul is done (gridtrain's stats, PaLM's convention); norms count (they are small).
    For a mixture of experts, the parameters a token passes through (its top_k routed experts)."""
    head = shape.vocab * shape.hidden if shape.tie_embeddings else 0
    counts = param_counts(shape)
    return counts.active - counts.embedding + head


def tp_weight_shard(rows: int, cols: int, tp: int, split: str) -> tuple[int, int]:
    """Shape of one rank's slice of a [rows x cols] weight (Y = X W): 'column' parallel splits the
    output columns, [rows, cols/t]; 'row' parallel the input rows, [rows/t, cols].
    Worked example: [8192 x 8192] column-parallel over 8 -> [8192 x 1024]."""
    if split == "column":
        if cols % tp:
            raise ValueError(f"tp ({tp}) must divide the {cols} output columns")
        return rows, cols // tp
    if split == "row":
        if rows % tp:
            raise ValueError(f"tp ({tp}) must divide the {rows} input rows")
        return rows // tp, cols
    raise ValueError(f"split must be 'column' or 'row', not {split!r}")


def tp_heads(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int, int]:
    """(query heads per rank, KV heads per rank, copies of each KV head) under TP.

    Query heads must divide evenly; when tp exceeds the KV heads, each rank holds one KV head
    and each is replicated tp / num_kv_heads times (Llama 3 70B's 64 Q and 8 KV heads: tp 8 ->
    8, 1, 1; tp 16 -> 4, 1, 2)."""
    if num_heads % tp:
        raise ValueError(f"tp ({tp}) must divide the {num_heads} query heads")
    if num_kv_heads % tp == 0:
        return num_heads // tp, num_kv_heads // tp, 1
    if tp % num_kv_heads:
        raise ValueError(f"tp ({tp}) and the {num_kv_heads} KV heads must divide one another")
    return num_heads // tp, 1, tp // num_kv_heads

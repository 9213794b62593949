"""`Layout`: one candidate way to run a model, as the planner sees it (degrees and step shape).

The degrees follow gridtrain.layout.dims.ParallelDims (mesh axes outer to inner: pp,
dp_replicate, dp_shard, cp, tp); the rest is what the planner needs beside them: the ZeRO
stage, the micro-batch and how many of them make a step, the pipeline schedule, sequence
parallelism and recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.layout.experts import expert_split
from gridtrain.layout.schedules import DEFAULT_SCHEDULE, ScheduleName
from gridtrain.names import PlanRecompute


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (ranks along the pipeline)."""
    cp: int = 1
    """Context-parallel degree: the sequence split over this many ranks (ring attention)."""
    dp_replicate: int = 1
    """Data-parallel ranks holding full copies (DDP, or HSDP's replicate axis)."""
    dp_shard: int = 1
    """Data-parallel ranks sharding the model state (ZeRO/FSDP)."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts layers only)."""
    zero_stage: int = 1
    """0: DDP; 1: optimizer state sharded; 2: and gradients; 3: and weights (FSDP)."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    seq_len: int = 2048
    """Tokens per sequence."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step per data-parallel rank (gradient accumulation steps)."""
    pp_schedule: ScheduleName = DEFAULT_SCHEDULE
    """Pipeline schedule: a name of gridtrain.layout.schedules.SCHEDULES."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (interleaving)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism on the TP group (norm and residual regions split too)."""
    recompute: PlanRecompute = "none"
    """Activation recomputation (gridtrain.names.PlanRecompute)."""
    flash_attention: bool = True
    """Fused attention that keeps no s x s scores (FlashAttention, SDPA)."""
    fewer_edge_layers: int = 0
    """Layers fewer on the first and last stage, which also hold embedding and head."""
    float8: str = "none"
    """FP8 training of the block linears (gridtrain.names.Float8; plan/float8.py)."""
    attention_span: float | None = None
    """With document masking (data.doc_mask), the keys a query attends to on average, sum L_i^2 / T
    over a sequence's documents (plan/documents.py); None: the whole sequence."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: slices of the global batch read at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """GPUs that jointly process one micro-batch: tp x pp x cp (the model-parallel group)."""
        return self.tp * self.pp * self.cp

    @property
    def num_gpus(self) -> int:
        return self.dp * self.model_parallel

    @property
    def tokens_per_microbatch(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def global_batch_seqs(self) -> int:
        """micro-batch x accumulation x DP."""
        return self.micro_batch * self.num_microbatches * self.dp

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_seqs * self.seq_len

    @property
    def expert_split(self) -> tuple[int, int]:
        """(edp_replicate, edp_shard): how the dp x cp / ep ranks holding the same routed experts
        keep them (gridtrain.layout.experts): FSDP-sharded over edp_shard, replicated over the rest."""
        return expert_split(self.dp_replicate, self.dp_shard, self.cp, self.ep, self.zero_stage)

    @property
    def zero_shard_degree(self) -> int:
        """Ranks the ZeRO-sharded state is split over: all DP ranks for stage 1 (gridtrain's
        ZeroRedundancyOptimizer over the whole DP group), dp_shard x cp for stages 2 and 3 (HSDP
        replicates over dp_replicate; the CP ranks of a batch slice hold the same weights, and
        gridtrain's FSDP shards over them too, as torchtitan does), 1 for DDP."""
        if self.zero_stage == 0:
            return 1
        return self.dp if self.zero_stage == 1 else self.dp_shard * self.cp

"""Where the routed experts' copies live under expert parallelism (no torch: the planner and the
runtime both read it).

The ep ranks are borrowed from the data- and context-parallel ranks, flattened in mesh order
(dp_replicate, dp_shard, cp) into D = dp x cp ranks: an ep group is ep consecutive ones, the inner
ranks first, as torchtitan borrows them from dp_shard x cp ('efsdp' x 'ep'). The D / ep ranks
left, one per ep group with the same position in it, hold the same E / ep experts: the expert
data-parallel ranks, split like the dense weights' data-parallel ranks into

    D = edp_replicate x edp_shard x ep        (flat rank = (r * edp_shard + s) * ep + e)

- ZeRO 0 (DDP beside EP): every copy whole, edp_shard = 1; the gradients summed over the
  edp_replicate = D / ep copies (an all-reduce, HSDP with shards of one rank).
- ZeRO 2 and 3: the experts FSDP-sharded over what is left of dp_shard x cp once ep has taken its
  ranks (edp_shard = dp_shard x cp / ep when ep divides it, else 1) and replicated over the rest,
  dp_replicate's ranks among them (HSDP), as the dense weights are. A sharded expert weight splits
  its dimension 1 (ffn for w1 and w3, dim for w2; dimension 0 is the experts, which ep splits).
"""

from __future__ import annotations

from gridtrain.layout.dims import ParallelDims


def expert_split(dp_replicate: int, dp_shard: int, cp: int, ep: int, zero_stage: int) -> tuple[int, int]:
    """(edp_replicate, edp_shard): how the D / ep ranks that hold the same experts keep them;
    (1, 1) without expert parallelism or when ep spans every data- and context-parallel rank."""
    if ep <= 1:
        return 1, 1
    left = dp_replicate * dp_shard * cp // ep
    inner = dp_shard * cp
    shard = inner // ep if zero_stage >= 2 and inner % ep == 0 else 1
    return left // shard, shard


def expert_data_parallel(dims: ParallelDims, zero_stage: int) -> tuple[int, int]:
    """expert_split of a run's degrees."""
    return expert_split(dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep, zero_stage)


def experts_fsdp_sharded(dims: ParallelDims, zero_stage: int = 0) -> bool:
    """Whether the routed experts are an FSDP unit of their own (over the expert data-parallel
    ranks, on their own mesh), rather than left alone by FSDP: when ep leaves data-parallel ranks
    over, whatever the ZeRO stage."""
    return dims.ep > 1 and dims.dp * dims.cp > dims.ep

"""The names gridtrain's accounting gives the process groups of a layout, as `plan --check` and
the dry run key collectives by them ('dp_shard/all_gather_bytes').

The accounting (parallel/accounting.py, CollectiveLog) names a group by the first entry of
parallel.mesh.Mesh.axis_groups that holds it: each mesh axis of more than one rank (pp,
dp_replicate, dp_shard, cp, tp), then the flattened 'dp' and 'dp_shard_cp', then 'world'. A group
that spans every rank is torch's default group, so the first such entry names it; any other
flattened group is a group of its own, named by its mesh description ('mesh_dp_cp' -> 'dp_cp').
"""

from __future__ import annotations

from gridtrain.layout.dims import ParallelDims
from gridtrain.layout.experts import expert_split


def world_axis(dims: ParallelDims) -> str:
    """The name the accounting gives the world's group (parallel.mesh.Mesh.axis_groups: an axis
    whose group spans every rank is that group, and the first such axis names it): a mesh axis
    of the world's size, else the flattened 'dp' or 'dp_shard_cp', else 'world'."""
    spans = [axis for axis, n in dims.degrees.items() if n == dims.world_size]
    spans += ["dp"] * (dims.dp == dims.world_size) + ["dp_shard_cp"] * (dims.cp > 1 and dims.dp_shard * dims.cp == dims.world_size)
    return (spans or ["world"])[0]


def fsdp_axis(dims: ParallelDims) -> tuple[str, int]:
    """The mesh axis FSDP shards over and its ranks: 'dp_shard', or under context parallelism
    dp_shard x cp ('dp_shard_cp'; torch flattens it into a group of its own, except when CP alone
    spans the world: then it is the CP axis's group, and the accounting names it 'cp')."""
    if dims.cp == 1:
        return "dp_shard", dims.dp_shard
    alone = dims.dp_shard == 1 and dims.cp == dims.world_size
    return ("cp" if alone else "dp_shard_cp"), dims.dp_shard * dims.cp


def ep_axis(dims: ParallelDims) -> str:
    """The group the routed experts are sharded over and their all-to-alls run on: when ep spans
    every data- and context-parallel rank, the flattened 'dp_cp' mesh (dp_replicate x dp_shard x
    cp; parallel/parallelize.py), the world's group when it spans every rank (world_axis), else one
    of its own ('dp_cp'); with ranks left over, the 'ep' axis of the experts' own mesh
    (parallel.mesh.Mesh.experts, unflattened: groups of their own)."""
    if dims.dp * dims.cp > dims.ep:
        return "ep"
    return world_axis(dims) if dims.dp * dims.cp == dims.world_size else "dp_cp"


def expert_norm_axis(dims: ParallelDims, zero_stage: int) -> str:
    """The group the gradient norm's scalars of the routed experts are all-reduced over: DTensor
    reduces them over the mesh axes that shard them, ep and edp_shard (gridtrain.layout.experts),
    flattened, and torch's flatten reuses an earlier flattened group of the same ranks, the first of
    'dp', 'dp_cp', 'dp_shard_cp' (parallel/mesh.py builds them in that order). Measured by dry runs:
    ep alone when edp_shard is 1 and ep is not all of dp_shard x cp; otherwise dp_shard x cp's
    ranks, as 'dp' (no replicas, no CP), 'dp_cp' (no replicas) or 'dp_shard_cp'."""
    if dims.dp * dims.cp == dims.ep:
        return ep_axis(dims)
    shard = expert_split(dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep, zero_stage)[1]
    if shard == 1 and dims.ep != dims.dp_shard * dims.cp:
        return "ep"
    if dims.dp_shard * dims.cp == dims.world_size:
        return world_axis(dims)
    if dims.dp_replicate == 1:
        return dp_axis(dims) if dims.cp == 1 else "dp_cp"
    return "dp_shard_cp"


def dp_axis(dims: ParallelDims) -> str:
    """The flattened 'dp' group (dp_replicate x dp_shard): the world's when it spans every rank,
    else its own ('dp', in axis_groups)."""
    return world_axis(dims) if dims.dp == dims.world_size else "dp"

"""The one DeviceMesh of a run, and the process group of each of its axes.

Axes outer to inner pp, dp_replicate, dp_shard, cp, tp (`gridtrain.layout.dims` explains the rank
grid), plus the flattened axes 'dp' (dp_replicate x dp_shard: the batch split and the loss
average), 'dp_cp', and 'dp_shard_cp' (what FSDP shards over under context parallelism: the CP
ranks of one batch slice hold the same weights, as torchtitan shards them). Under expert
parallelism with data-parallel ranks left over, 'dp_cp' is unflattened into (edp_replicate,
edp_shard, ep) (`gridtrain.layout.experts`): the experts' own mesh, beside the dense one.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gridtrain.layout.dims import MESH_AXES, ParallelDims
from gridtrain.layout.experts import expert_data_parallel


class Mesh:
    """The root DeviceMesh, with its flattened axes kept beside it (torch wants them bookkept
    rather than sliced from the root): `mesh["tp"]`, `mesh["dp_replicate", "dp_shard"]`,
    `mesh["dp"]`."""

    def __init__(self, dims: ParallelDims, root: DeviceMesh, flat: dict[str, DeviceMesh],
                 experts: dict[tuple, DeviceMesh]) -> None:
        self.dims = dims
        self.root = root
        self.flat = flat
        self._experts = experts
        """The experts' meshes built on this root, by shape (kept with it: `_Built`)."""

    def __getitem__(self, axes: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(axes, str) and axes in self.flat:
            return self.flat[axes]
        return self.root[axes]

    def experts(self, zero_stage: int) -> DeviceMesh:
        """The experts' mesh (edp_replicate, edp_shard, ep), unflattened from 'dp_cp' so that it
        shares the root with the dense axes (FSDP concatenates the two); built once, on every rank
        alike (it creates process groups)."""
        if "experts" not in self.flat:
            replicate, shard = expert_data_parallel(self.dims, zero_stage)
            shape = (replicate, shard, self.dims.ep)
            if shape not in self._experts:
                self._experts[shape] = self.flat["dp_cp"]._unflatten(0, shape, ("edp_replicate", "edp_shard", "ep"))
            self.flat["experts"] = self._experts[shape]
        return self.flat["experts"]

    def axis_groups(self) -> dict[str, dist.ProcessGroup]:
        """Process group of each mesh axis with more than one rank, then the flattened 'dp', the
        experts' axes (Mesh.experts, once built) and the world: what the collective log names its
        records by."""
        groups = {axis: self[axis].get_group() for axis, n in self.dims.degrees.items() if n > 1}
        if self.dims.dp > 1:
            groups["dp"] = self["dp"].get_group()
        if self.dims.cp > 1:  # a group of its own, unless CP alone spans the world (then 'cp' names it)
            groups["dp_shard_cp"] = self["dp_shard_cp"].get_group()
        if "experts" in self.flat:  # the experts' mesh, once parallelize has built it
            groups.update((axis, self.flat["experts"][axis].get_group())
                          for axis in ("ep", "edp_replicate", "edp_shard") if self.flat["experts"][axis].size() > 1)
        groups["world"] = dist.group.WORLD
        return groups


class _Built:
    """The meshes this process built in its current default group, by shape: a process that
    builds several Trainers of one layout (a parity launch builds hundreds) makes their process
    groups once. Each group torch keeps slows the next one's creation and every read of the flight
    recorder, which lists them all (`gridtrain.parity.run.forget_case_groups` destroys the
    others); and DTensor's sharding cache takes meshes of one shape and axis names for one (it
    compares no groups), so a DTensor of a later mesh may run on an earlier mesh's groups, which
    must therefore live. Emptied when the default group changes (a process group torn down and
    made again, as dry runs do)."""

    def __init__(self) -> None:
        self.world: object = None
        self.roots: dict[tuple, tuple[DeviceMesh, dict[str, DeviceMesh], dict[tuple, DeviceMesh]]] = {}
        """(shape, device type) -> the root, its flattened axes, its experts' meshes."""

    def current(self) -> _Built:
        if self.world is not dist.group.WORLD:
            self.world, self.roots = dist.group.WORLD, {}
        return self

    def groups(self) -> list[dist.ProcessGroup]:
        """The process groups of every mesh kept."""
        meshes = [m for root, flat, experts in self.current().roots.values()
                  for m in (root, *flat.values(), *experts.values())]
        return [g for m in meshes for g in m.get_all_groups()]


_BUILT = _Built()


def build_mesh(dims: ParallelDims, device_type: str) -> Mesh:
    """The run's mesh; one built before in this process for the same shape is reused (_Built)."""
    shape = tuple(dims.degrees.values())
    built = _BUILT.current()
    if (shape, device_type) not in built.roots:
        root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        flat = {"dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
                "dp_cp": root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
                "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp")}
        built.roots[shape, device_type] = root, flat, {}
    root, flat, experts = built.roots[shape, device_type]
    return Mesh(dims, root, dict(flat), experts)


def mesh_groups() -> list[dist.ProcessGroup]:
    """The process groups of the meshes this process keeps for reuse (`build_mesh`)."""
    return _BUILT.groups()


def group(mesh: Mesh | None, axis: str) -> dist.ProcessGroup | None:
    """The process group of a mesh axis ('dp' flattened, 'world' for all ranks); None in a world
    of one (no mesh) or when the axis has one rank."""
    if mesh is None:
        return None
    if axis == "world":
        return dist.group.WORLD
    size = mesh.dims.dp if axis == "dp" else mesh.dims.degrees[axis]
    return mesh[axis].get_group() if size > 1 else None


def expert_fsdp_mesh(experts: DeviceMesh | None) -> DeviceMesh | None:
    """What FSDP keeps the experts over, from their mesh (Mesh.experts): 'edp_shard' alone when
    no copies are left to replicate over, else (edp_replicate, edp_shard) as HSDP (with shards of
    one rank: replicated, the gradients all-reduced), as the dense weights beside EP; None
    without an experts' mesh."""
    if experts is None:
        return None
    return experts["edp_shard"] if experts["edp_replicate"].size() == 1 else experts["edp_replicate", "edp_shard"]

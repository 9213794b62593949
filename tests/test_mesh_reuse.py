"""A process that builds several Trainers keeps one mesh per shape (`gridtrain.parallel.mesh.build_mesh`),
and a parity launch destroys every other group a case made (`gridtrain.parity.run.forget_case_groups`):
torch keeps every group it makes, and each one slowed the next case of a launch (a 2-rank case took
1.45 s as the 40th of a launch against 0.5 s as the 2nd). Under the fake process group, rank 0 of 8."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gridtrain.layout.dims import ParallelDims
from gridtrain.parallel.mesh import build_mesh, mesh_groups
from gridtrain.parity.run import forget_case_groups


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    def join() -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)

    join()
    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def dims(**degrees: int) -> ParallelDims:
    d = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    return ParallelDims(**d, world_size=d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"])


def live_groups() -> int:
    return len(c10d._world.pg_map)


def test_a_second_mesh_of_one_shape_reuses_the_first_and_its_groups(fake_world):
    a = build_mesh(dims(dp_shard=4, tp=2), "cpu")
    made = live_groups()
    b = build_mesh(dims(dp_shard=4, tp=2), "cpu")
    assert b.root is a.root and b["dp"] is a["dp"] and b["tp"].get_group() is a["tp"].get_group()
    assert live_groups() == made  # no group made for the second
    c = build_mesh(dims(dp_shard=2, tp=4), "cpu")  # another shape: a mesh of its own
    assert c.root is not a.root and live_groups() > made


def test_the_experts_mesh_is_kept_per_shape_and_a_mesh_does_not_see_another_trainers(fake_world):
    first = build_mesh(dims(dp_shard=4, tp=2, ep=2), "cpu")
    fsdp = first.experts(zero_stage=3)  # experts sharded over the 2 data-parallel ranks ep leaves
    again = build_mesh(dims(dp_shard=4, tp=2, ep=2), "cpu")
    assert "experts" not in again.flat  # each Trainer's Mesh builds (or finds) its own
    assert again.experts(zero_stage=3) is fsdp
    ddp = build_mesh(dims(dp_shard=4, tp=2, ep=2), "cpu").experts(zero_stage=0)
    assert ddp is not fsdp and (ddp["edp_replicate"].size(), ddp["edp_shard"].size()) == (2, 1)
    assert (fsdp["edp_replicate"].size(), fsdp["edp_shard"].size()) == (1, 2)


def test_forgetting_a_case_keeps_the_default_and_the_meshes_groups_only(fake_world):
    mesh = build_mesh(dims(dp_shard=2, cp=2, tp=2), "cpu")
    kept = live_groups()
    other = dist.new_group()  # as a Checkpointer makes one for itself
    assert live_groups() == kept + 1
    forget_case_groups()
    assert live_groups() == kept and other not in c10d._world.pg_map
    assert set(mesh_groups()) | {dist.group.WORLD} == set(c10d._world.pg_map)
    assert build_mesh(dims(dp_shard=2, cp=2, tp=2), "cpu").root is mesh.root  # still there to reuse


def test_a_new_default_group_builds_its_meshes_anew(fake_world):
    old = build_mesh(dims(dp_shard=8), "cpu")
    dist.destroy_process_group()
    fake_world()
    new = build_mesh(dims(dp_shard=8), "cpu")
    assert new.root is not old.root
    assert all(g in c10d._world.pg_map for g in mesh_groups())

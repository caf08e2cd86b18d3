"""Process groups are shared: one per rank for every one-rank kind, and one per (stream, ranks) across every
mesh built on the same world (runners/mesh.py), so a process holding many trainers holds few groups."""

import datetime

import pytest
import torch.distributed as dist

from runners.mesh import build_mesh
from specs.plan import Plan
from tests.distributed.harness import free_port


@pytest.fixture
def world_of_one():
    def init():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))

    init()
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_meshes_on_one_world_share_their_groups_and_a_new_world_gets_its_own(world_of_one):
    zero3 = build_mesh(Plan(dp=1, param_shard=1, grad_shard=1, optim_shard=1), ranks_per_node=1)
    again = build_mesh(Plan(dp=1, micro_batch=2), ranks_per_node=1)
    # Every group of a one-process world is one rank: all kinds are the one solo group.
    assert len({id(g) for g in zero3.groups.values()}) == 1
    assert {id(g) for g in again.groups.values()} == {id(g) for g in zero3.groups.values()}
    dist.destroy_process_group()
    world_of_one()
    fresh = build_mesh(Plan(dp=1), ranks_per_node=1)
    assert {id(g) for g in fresh.groups.values()}.isdisjoint({id(g) for g in zero3.groups.values()})
    assert dist.get_process_group_ranks(next(iter(fresh.groups.values()))) == [0]

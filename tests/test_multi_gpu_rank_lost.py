"""A multi-GPU replica whose local rank died decides nothing about the attempt (issue 37, DESIGN.md 12 and 14).

Local rank 0 of a one-replica run exchanges its shard through a real ``file://`` store while its peer rank (a
real second process in the replica's gloo group) has died: the vote cannot complete, the rank raises
``LocalRankLost`` and leaves the attempt undecided (no outcome record), so the restarted replica can rejoin it
with the same pseudo-gradient. Before the fix it created a "missing replica" abort, which ended the sync and
re-ran the round from fresh inner steps: a completed run on a model other than the uninterrupted run's.
End to end (kill -9 of a local rank, restart, bitwise model): test_multi_gpu_local_ranks.py.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from composer_cloud.storage.store import Store
from composer_cloud.sync.lockstep.results import LocalRankLost
from composer_cloud.sync.lockstep.rounds import read_outcome, read_quorum
from composer_cloud.sync.lockstep.sharded import LocalShard, ShardedAllReduce
from workers import allreduce_config

#: The peer local rank: joins the replica's group, then dies (``os._exit``) before the round's vote.
_PEER = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2, timeout=timedelta(seconds=60))
os._exit(0)
"""


@pytest.fixture
def group_with_a_dead_peer(tmp_path):
    """This process as local rank 0 of a 2-rank gloo group whose rank 1 has exited."""
    init = f"file://{tmp_path}/rendezvous"
    peer = subprocess.Popen([sys.executable, "-c", _PEER, init])
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=60))
        assert peer.wait(timeout=60) == 0
        yield dist.group.WORLD
    finally:
        peer.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_rank_whose_peer_died_leaves_the_attempt_undecided(tmp_path, group_with_a_dead_peer):
    store = Store(f"file://{tmp_path}/store")
    exchange = ShardedAllReduce(store, 0, allreduce_config(1, min_replicas=1),
                                shard=LocalShard(index=0, count=2, group=group_with_a_dead_peer))
    flat = torch.linspace(-1.0, 1.0, 64)
    before = flat.clone()
    try:
        with pytest.raises(LocalRankLost, match="round 1 attempt 0: local rank 0 lost a peer rank"):
            exchange.allreduce(0, flat)
    finally:
        exchange.close()
    # The attempt ran up to the vote (quorum decided, shard payload reduced) and nobody decided it.
    assert read_quorum(store, 0, 0, replicas=1) is not None
    assert read_outcome(store, 0, 0, replicas=1) is None
    assert torch.equal(flat, before)  # nothing applied

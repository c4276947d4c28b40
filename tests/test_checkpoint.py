"""Checkpoint layout: global state in slices, verified reads, fallback past a bad object, resume points."""

from __future__ import annotations

import threading

import pytest
import torch

from composer_cloud.errors import CorruptCheckpoint
from composer_cloud.storage.store import Store
from composer_cloud.storage.tensors import flatten
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore, split_global_state
from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore

A = 0  # the attempt every state here belongs to (the sync layer names it; here: by hand)


def _attempt_0(round: int) -> int:
    return A


def _tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"StreamingDiLoCoFragment_0": {
        "original_parameters": {f"w{i}": torch.randn(17 + 5 * i, 3, generator=g) for i in range(6)},
        "outer_optimizer": {"state": {0: {"momentum_buffer": torch.randn(4, generator=g)}}, "param_groups": [
            {"lr": 0.7, "momentum": 0.9, "nesterov": True, "params": [0]}]}}}


def _same(a: dict, b: dict) -> bool:
    ta, sa = flatten(a)
    tb, sb = flatten(b)
    return sa == sb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_slices_are_deterministic_cover_the_state_and_round_trip(tmp_path, n):
    tree = _tree()
    a, b = split_global_state(tree, n), split_global_state(_tree(), n)
    assert [a.encode(i, round=0) for i in range(n)] == [b.encode(i, round=0) for i in range(n)]
    assert sorted(k for g in a.groups for k in g) == sorted(a.tensors)
    states = GlobalStateStore(Store(f"file://{tmp_path}/s"))
    for i in range(n):  # each participant writes its own slice
        assert states.write_slice(3, A, a, i, writer=i) > 0
        assert states.durable(3, A) == (i == n - 1)
    assert not states.durable(3, A + 1)  # another attempt's state is another state
    assert states.write_slice(3, A, a, 0, writer=1) == 0  # a taker-over writes nothing twice
    assert _same(states.load(3, A), tree)


def test_a_well_framed_but_malformed_global_slice_is_never_used(tmp_path):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    for r in (0, 1):
        states.write(r, A, _tree(r), writer=0, num_slices=2)
        for rank in (0, 1):
            replicas.write(r, rank, {"x": torch.ones(2)}, world_size=2)
        assert manifests.write_manifest(states, replicas, r, A, [0, 1], deadline_s=5)
    assert manifests.latest_checkpoint(states, _attempt_0).round == 1
    assert manifests.latest_checkpoint(states, lambda r: A + 1) is None  # every manifest names another attempt
    # Valid framing (the store's crc32 matches), garbage content: the marker's/manifest's crc32 differs.
    store.put("checkpoints/00000001/global-a0-1-of-2.safetensors", b"not a safetensors blob")
    with pytest.raises(CorruptCheckpoint, match="global-a0-1-of-2"):
        states.load(1, A)
    assert manifests.latest_checkpoint(states, _attempt_0).round == 0  # resume and export fall back


def test_resume_point_prefers_own_state_of_the_newest_durable_round(tmp_path):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)

    def resume_point(rank: int, world_size: int):
        return replicas.resume_point(rank, world_size=world_size, durable_rounds=states.durable_rounds(_attempt_0))

    assert resume_point(0, 2) is None
    for r in (0, 1, 2):
        states.write(r, A, _tree(r), writer=0, num_slices=2)
    replicas.write(1, 0, {"x": torch.ones(2)}, world_size=2)
    point = resume_point(0, 2)
    assert point.round == 1 and point.replica_crc32 is not None  # exact: own state at round 1
    point = resume_point(1, 2)
    assert point.round == 2 and point.replica_crc32 is None and "no state for replica 1" in point.reason
    point = resume_point(0, 3)  # another replica count: data positions mean nothing
    assert point.round == 2 and point.replica_crc32 is None and "2 replicas, now 3" in point.reason


def _pruned_on_read(store: Store, round: int, kind: str) -> list[str]:
    """Make the first read of a ``kind`` blob ("global" or "replica", not a marker) of checkpoint ``round`` find
    that round pruned, as a restarted replica does when the fleet moves on while it reads. Returns keys read."""
    from composer_cloud.storage import layout

    reads: list[str] = []
    get = store.get

    def racing_get(key: str, *args, **kwargs):
        reads.append(key)
        name = key.rsplit("/", 1)[1]
        if key.startswith(layout.checkpoint_prefix(round)) and name.startswith(kind) and \
                name.endswith(".safetensors") and store.exists(key):
            manifests.prune(GlobalStateStore(store), keep=1, newest=round + 2)
        return get(key, *args, **kwargs)

    store.get = racing_get
    return reads


@pytest.mark.parametrize("kind", ["global", "replica"])
def test_a_resume_point_pruned_while_it_is_read_is_chosen_again(tmp_path, kind):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    for r in (0, 1, 2):
        participants = [0, 1] if r == 0 else [0]  # replica 1 was killed after round 0: its own state is round 0's
        states.write(r, A, _tree(r), writer=0, num_slices=len(participants))
        for rank in participants:
            replicas.write(r, rank, {"x": torch.full((2,), float(r))}, world_size=2)
        assert manifests.write_manifest(states, replicas, r, A, participants, deadline_s=5)
    reads = _pruned_on_read(store, 0, kind)
    loaded = manifests.load_resume(states, replicas, 1, world_size=2, attempt_of=_attempt_0)
    assert any(k.startswith("checkpoints/00000000/") for k in reads)  # it did choose round 0 first
    assert not states.durable(0, A)  # and round 0 is gone
    assert loaded.point.round == 2 and loaded.replica_state is None and "no state for replica 1" in loaded.point.reason
    assert _same(loaded.global_state, _tree(2))
    # Replica 0's own state of round 2 is still there: an exact resume.
    own = manifests.load_resume(states, replicas, 0, world_size=2, attempt_of=_attempt_0)
    assert own.point.round == 2 and torch.equal(own.replica_state["x"], torch.full((2,), 2.0))


def test_a_damaged_resume_point_that_is_still_durable_is_not_skipped_silently(tmp_path):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    for r in (0, 1):
        states.write(r, A, _tree(r), writer=0, num_slices=2)
        replicas.write(r, 0, {"x": torch.full((2,), float(r))}, world_size=2)
    store.put("checkpoints/00000001/replica-0.safetensors", b"damaged")  # own state: fresh inner state instead
    loaded = manifests.load_resume(states, replicas, 0, world_size=2, attempt_of=_attempt_0)
    assert loaded.point.round == 1 and loaded.replica_state is None and _same(loaded.global_state, _tree(1))
    store.put("checkpoints/00000001/global-a0-1-of-2.safetensors", b"damaged")  # global state: an error
    with pytest.raises(CorruptCheckpoint, match="global-a0-1-of-2"):
        manifests.load_resume(states, replicas, 0, world_size=2, attempt_of=_attempt_0)


def _encoding_digests() -> list[str]:
    """SHA-256 of both shards of a split global state and of one tensor in every codec."""
    import hashlib

    from composer_cloud.sync.lockstep import codec

    s = split_global_state(_tree(), 2)
    x = torch.arange(1000, dtype=torch.float32)
    blobs = [s.encode(0, round=5), s.encode(1, round=5)] + [codec.encode(c, x) for c in codec.CODECS]
    return [hashlib.sha256(b).hexdigest() for b in blobs]


def test_encodings_are_byte_identical_across_processes():
    """A taker-over must write the owner's bytes: safetensors' metadata order differs between calls
    and processes, so our blobs keep one metadata key. Three processes: this one and two fresh interpreters."""
    import subprocess
    import sys

    code = "import sys; sys.path.insert(0, sys.argv[1]); from test_checkpoint import _encoding_digests as d; print(d())"
    here = str(__import__("pathlib").Path(__file__).parent)
    outs = {subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert outs == {f"{_encoding_digests()}\n"}, outs


class _PrunedAround(Store):
    """A store where a newer checkpoint's prune removes ``checkpoints/<round>/`` just before or just after
    the manifest of ``round`` is created (a late manifest writer)."""

    def __init__(self, uri: str, *, round: int, when: str) -> None:
        super().__init__(uri)
        self.prefix, self.when = f"checkpoints/{round:08d}", when

    def create(self, key, payload, **kw):
        if key != f"{self.prefix}/manifest.json":
            return super().create(key, payload, **kw)
        if self.when == "before":
            self.delete(self.prefix, recursive=True)
        created = super().create(key, payload, **kw)
        if self.when == "after":  # the prune listed the checkpoint before the manifest appeared
            for k in self.list(self.prefix):
                if not k.endswith("manifest.json"):
                    self.delete(k)
        return created


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_late_manifest_never_lists_pruned_objects(tmp_path, when):
    uri = f"file://{tmp_path}/s"
    store = _PrunedAround(uri, round=0, when=when)
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    states.write(0, A, _tree(0), writer=0, num_slices=2)
    for rank in (0, 1):
        replicas.write(0, rank, {"x": torch.ones(2)}, world_size=2)
    assert not manifests.write_manifest(states, replicas, 0, A, [0, 1], deadline_s=5)
    assert not Store(uri).exists("checkpoints/00000000/manifest.json")
    assert manifests.latest_checkpoint(states, _attempt_0) is None


def test_the_manifest_does_not_wait_for_the_inner_state_of_a_replica_whose_slice_was_taken_over(tmp_path):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    slices = split_global_state(_tree(0), 2)
    states.write_slice(0, A, slices, 0, writer=1)  # replica 0 died: replica 1 wrote its slice
    states.write_slice(0, A, slices, 1, writer=1)
    replicas.write(0, 1, {"x": torch.ones(2)}, world_size=2)
    # The deadline is the round's (long); the answer for replica 0 is already decided, so the writer
    # returns long before it (a generous bound: a tenth of the deadline).
    done = []
    writer = threading.Thread(target=lambda: done.append(
        manifests.write_manifest(states, replicas, 0, A, [0, 1], deadline_s=1200)), daemon=True)
    writer.start()
    writer.join(timeout=120)
    assert done == [True], "the manifest writer waited for a replica whose slice was taken over"
    manifest = manifests.read_manifest(states, 0)
    assert sorted(manifest.replicas) == [1] and manifest.participants == [0, 1]


def test_the_manifest_writer_stops_waiting_once_the_commit_is_abandoned(tmp_path):
    store = Store(f"file://{tmp_path}/s")
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    states.write_slice(0, A, split_global_state(_tree(0), 2), 1, writer=1)  # slice 0 never comes
    checks = []

    def abandoned() -> bool:
        checks.append(1)
        return len(checks) >= 2  # the commit is voided while the writer waits

    assert not manifests.write_manifest(states, replicas, 0, A, [0, 1], deadline_s=120, abandoned=abandoned)
    assert len(checks) == 2 and not store.exists("checkpoints/00000000/manifest.json")

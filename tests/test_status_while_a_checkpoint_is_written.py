"""Issue 34's newcomer walk: a healthy two-round demo printed, between its progress lines,
``WARNING ... checkpoint .../00000000 has no valid manifest (torn write?); skipping it`` three times: the
attached launch's status poll met checkpoints whose replicas had not written the manifest yet (it comes
last). ``status`` reports what is missing itself (its problems), so its poll skips such a checkpoint quietly;
``export`` and ``resume`` still warn."""

from __future__ import annotations

import logging

from composer_cloud import runs
from composer_cloud.runs import sync_state
from composer_cloud.spec import RunSpec
from composer_cloud.storage import layout
from composer_cloud.storage.run import Run
from composer_cloud.storage.store import Store

MANIFESTS = "composer_cloud.sync.checkpoint.manifests"


def test_status_polls_a_checkpoint_without_its_manifest_quietly_and_export_still_warns(tmp_path, caplog):
    store = Store(f"file://{tmp_path}/store/run")
    spec = RunSpec(run_id="run", replicas=1, rounds=2)
    store.put(f"{layout.checkpoint_prefix(0)}/global-a0-0-of-1.safetensors", b"being written")
    run = Run(uri=store.uri, store=store, spec=spec)
    with caplog.at_level(logging.WARNING, logger=MANIFESTS):
        runs.get_status(run)
    assert not [r for r in caplog.records if r.name == MANIFESTS], caplog.text
    with caplog.at_level(logging.WARNING, logger=MANIFESTS):
        assert sync_state.latest_model(store, spec, verify=False) is None  # export's and resume's reading
    assert "has no valid manifest (still being written, or torn)" in caplog.text, caplog.text

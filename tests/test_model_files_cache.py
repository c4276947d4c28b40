"""The launcher's files of the built-in model come from a cache keyed by everything that shapes them: a hit is
byte-identical to a fresh build and imports no transformers; a changed shape or a damaged entry is built again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from composer_cloud.runs import export
from composer_cloud.spec import RunSpec

_PROBE = """
import json, sys
from composer_cloud.runs.export import model_files
from composer_cloud.spec import RunSpec
files = model_files(RunSpec.model_validate({"run_id": "x", "store": "file:///nowhere", "model": json.loads(sys.argv[1])}))
print(json.dumps({"files": {k: v.decode() for k, v in files.items()}, "transformers": "transformers" in sys.modules}))
"""


def _model_files_in_a_new_process(cache, model: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(model)], capture_output=True, text=True,
                         env={**os.environ, "COMPOSER_CLOUD_CACHE": str(cache)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hit_is_a_fresh_builds_bytes_without_importing_transformers(tmp_path):
    model = {"hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 96}
    built = _model_files_in_a_new_process(tmp_path, model)
    hit = _model_files_in_a_new_process(tmp_path, model)
    assert built["transformers"] and not hit["transformers"]
    assert hit["files"] == built["files"] and json.loads(hit["files"]["config.json"])["hidden_size"] == 48
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(hit["files"])


def test_the_key_follows_the_shape_and_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("COMPOSER_CLOUD_CACHE", str(tmp_path))
    spec = RunSpec.model_validate({"run_id": "x", "store": "file:///nowhere", "model": {"hidden_size": 32}})
    other = RunSpec.model_validate({"run_id": "x", "store": "file:///nowhere", "model": {"hidden_size": 64}})
    same_shape = RunSpec.model_validate({"run_id": "y", "store": "file:///elsewhere", "seed": 7,
                                         "model": {"hidden_size": 32}})
    assert export._tiny_files_cache(spec) != export._tiny_files_cache(other)
    assert export._tiny_files_cache(spec) == export._tiny_files_cache(same_shape)  # run id, store, seed: not shape
    files = export.model_files(spec)
    entry = export._tiny_files_cache(spec)
    assert json.loads((entry / "complete").read_text()) == sorted(files)
    (entry / "tokenizer.json").unlink()  # a damaged entry: listed, missing
    assert export.model_files(spec) == files
    assert "unreadable" in caplog.text and (entry / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert json.loads(export.model_files(other)["config.json"])["hidden_size"] == 64

"""`export --push-to-hub REPO` (issue 34, What to build 6) against a local Hub stand-in (tests/hub_server.py): the
real huggingface_hub client creates the repo and commits the exported folder; the token is never printed."""

from __future__ import annotations

import json
import os

import pytest
from hub_server import HubServer
from support.cli import cli, cli_here

TOKEN = "hf_testtoken_do_not_print_0123456789"


@pytest.mark.slow
def test_export_pushes_the_model_folder_to_the_hub_and_never_prints_the_token(tmp_path):
    from safetensors.torch import load_file

    from support.resume import launch_and_wait

    store = f"file://{tmp_path}/store"
    launch_and_wait(tmp_path, store, "hub", """
replicas = 1
rounds = 1
inner_steps = 1
[model]
hidden_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
intermediate_size = 64
[trainer]
name = "causal-lm"
batch_size = 2
seq_len = 16
""")
    # The exports that hold the token run as processes: all they print (warnings, logs included) is checked.
    with HubServer(tmp_path / "hub", token=TOKEN) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1"}
        out = cli("export", f"{store}/hub", "--out", str(tmp_path / "model"), "--push-to-hub", "tester/tiny",
                  "--json", cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert TOKEN not in out.stdout + out.stderr
        assert json.loads(out.stdout)["hub"].startswith(f"{hub.endpoint}/tester/tiny/commit/")
        (commit,) = hub.commits
        assert commit["summary"] == "hub, after round 1/1"  # export's own words: after round 1 of 1
        pushed = tmp_path / "hub" / "tester" / "tiny"
        assert {"config.json", "model.safetensors", "README.md"} <= set(commit["files"])
        local, remote = load_file(tmp_path / "model" / "model.safetensors"), load_file(pushed / "model.safetensors")
        assert local.keys() == remote.keys() and all(local[k].equal(remote[k]) for k in local)
        # A token the Hub refuses: exit 1, the Hub's status named, the token not printed.
        bad = cli("export", f"{store}/hub", "--out", str(tmp_path / "again"), "--push-to-hub", "tester/tiny",
                  cwd=tmp_path, env={**env, "HF_TOKEN": TOKEN + "x"})
        assert bad.returncode == 1 and "HTTP 401" in bad.stderr and TOKEN not in bad.stdout + bad.stderr
    bad_id = cli_here("export", f"{store}/hub", "--out", str(tmp_path / "never"), "--push-to-hub", "not a repo",
                      cwd=tmp_path)
    assert bad_id.exit_code == 2 and "--push-to-hub" in bad_id.stderr and not (tmp_path / "never").exists()

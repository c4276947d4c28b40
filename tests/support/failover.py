"""Launch a run and SIGKILL one replica at a stalled phase: the failover modules' shared step."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.local_jobs import kill_replica, launch_stalled
from support.specs import RESUME_SPEC, with_sync


def launch_and_kill_replica_at(tmp_path: Path, store: str, run_id: str, phase: str, round: int,
                               extra: str, **sync: float) -> subprocess.Popen:
    """Launch attached, wait until rank 0 stalls at ``phase`` of ``round``, SIGKILL that replica only."""
    cfg = tmp_path / f"{run_id}.toml"
    cfg.write_text(extra + with_sync(RESUME_SPEC, quorum_timeout_s=15, **{"heal_timeout_s": 30, **sync}))
    launcher = launch_stalled(tmp_path, cfg, store, run_id, phase=phase, round=round, rank=0)
    kill_replica(f"{store}/{run_id}", 0)
    return launcher

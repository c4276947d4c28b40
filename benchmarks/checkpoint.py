#!/usr/bin/env python
"""Round-checkpoint cost: bytes, snapshot/encode/write/read times, peak memory, share of a round.

    python benchmarks/checkpoint.py                  # tiny (file://, S3), mid (file://), 0.5B (file://): ~7 min
    python benchmarks/checkpoint.py --skip-big       # without the 0.5B case (~1.5 min)
    python benchmarks/checkpoint.py --models tiny,mid --mid-s3 --json out.json
    python benchmarks/checkpoint.py --big-h 100 --big-step-s 0.5   # the assumed 0.5B round (see below)

Needs ~17 GiB of free RAM and ~13 GB of disk for the 0.5B case (writing one
3.95 GB state object peaks at 4x its size); a phase is skipped, with the
reason, when memory is short, and a case is aborted if the machine's
available memory falls below ``--memory-floor-gb`` (the machine may be shared).

What a checkpoint costs a round (``composer_cloud/replica.py`` ``_after_commit``,
``rendezvous/manager.py`` ``_publish_global_state``, ``composer_cloud/checkpoint.py``):

* on the critical path: every participant's ``manager.publish_state()`` calls every
  fragment's ``save_fn`` (torchft clones ``original_parameters``; the outer
  optimizer state is referenced) **every committed round**; on checkpoint rounds every
  replica takes ``_snapshot(checkpoint.replica_state(trainer))``;
* in the background: each of the W participants encodes and uploads its 1/W
  slice of the global state (``split_global_state`` + ``write_global_shard``;
  joined by ``flush_state()`` at the next ``start_quorum``), and writes missing
  slices itself after ``takeover_after_s``; each replica's
  ``write_replica_state``; any participant's ``write_manifest`` (``_io`` pool).

Models:

``tiny``
    The built-in model (``load_model("tiny", seed=0)``), with the real
    causal-LM trainer: its AdamW state after real inner steps is the replica
    state; the global state is what torchft's fragment ``save_fn`` returns
    (a clone of the parameters + the outer Nesterov-SGD ``state_dict()``).
``mid``
    Synthetic fp32 weights shaped like a ~55 M-param Qwen2 (vocab 32000,
    hidden 640, 8 layers).
``0.5b``
    Synthetic fp32 weights shaped exactly like Qwen2.5-0.5B (494 M params,
    290 tensors; shapes from a ``Qwen2Config`` on the meta device, nothing is
    downloaded). Global state ≈ 2 × 1.98 GB, replica state ≈ 2 × 1.98 GB.

For each (model, store) a fresh child process (so memory of one case never
inflates another) runs the library's own public functions on a scratch store:

1. **global snapshot** — ``{key: save_fn()}`` as ``_maybe_publish_state``
   builds it; **global write** — the whole state by one writer
   (``write_global_shard`` of ``split_global_state(tree, 1)``);
2. **global upload per participant** at W = ``--world-sizes`` (2, 4, 8):
   before = the 951ee6d leader's upload of the whole state (``encode_state`` →
   ``global.safetensors`` → ``global.json``, the three lines of the old
   ``ObjectStoreManager._write_global_state``); after = ``write_global_shard``
   of slice i by participant i, each with its own ``Store`` object so that
   ``Store.bytes_written`` is that participant's upload (max, mean, slowest);
3. **replica snapshot** and ``write_replica_state``; repeats (small states) and
   both writes at once;
4. ``write_manifest`` of a checkpoint with ``--resume-w`` replicas (global
   state in W slices, every replica's state);
5. **resume reads**, each on a fresh ``Store`` (its ``bytes_read``): the
   launcher's ``latest_checkpoint(verify=True)``, and one replica's startup
   (``resume_point`` + ``load_global`` + ``load_replica_at``), every decoded
   tensor compared (crc32) with what was written; **before**: the same
   checkpoint written and read by ``git show 951ee6d:composer_cloud/checkpoint.py``
   (loaded as a separate module, ``old_checkpoint_951ee6d``): its launcher's
   ``latest_checkpoint(verify=True)`` and its replica startup
   (``latest_checkpoint`` + ``load_global`` + ``load_replica``);
6. **rounds** (tiny) — alternating plain rounds (H inner steps), global-only
   rounds and checkpoint rounds of participant 0 of W = ``--resume-w``, done as
   the runtime does them (snapshots on the critical path, its slice and its
   replica write in background threads during the H steps, the slice upload
   joined at the end like ``start_quorum`` does).

For ``0.5b`` the round is an explicit assumption (``--big-h`` inner steps ×
``--big-step-s`` seconds per step on an H100), stated in the output.

No library module is patched. Store time is measured by a wrapper *instance*
around the ``Store`` object passed to the library (``TimedStore``); a library
call's time minus its store time is its encode/decode time. Peak memory per
phase is the kernel's high-water mark (``VmHWM``, reset via
``/proc/self/clear_refs``) above the phase's starting RSS. Small states (tiny)
are written ``--repeats`` more times (medians and minima reported). A
machine-state line (copy, crc32 and fsync throughput, load average) is
measured first and stored as ``calibration``.

Files: this one (options, the child processes, summary and tables),
``checkpoint_case.py`` (the phases measured in a child), ``checkpoint_states.py``
(the states written), ``checkpoint_before.py`` (the 951ee6d code, from git).

S3 runs against a loopback ``moto_server`` (tests/s3server.py); it is
in-memory, so only tiny (and with ``--mid-s3`` mid) go through it. Its
bandwidth says nothing about real S3; it exercises the real client path
(s3fs single PUT below 100 MiB, multipart above).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # s3server: the loopback moto server of the test suite

from checkpoint_before import OLD_COMMIT  # noqa: E402
from checkpoint_case import MB, run_case  # noqa: E402

DEFAULT_JSON = os.path.join(ROOT, "benchmarks", "out", "checkpoint.json")


def calibrate(workdir: str, mb: int = 256) -> dict[str, float]:
    """This machine's primitives at the moment of the run: copy into fresh memory, crc32, write+fsync."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, size=mb * 2**20, dtype=np.uint8).tobytes()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    dup = bytes(memoryview(src))  # what frame() and decode_state() do: a copy into freshly allocated memory
    out["fresh_copy_gbps"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 2)
    del dup
    t0 = time.perf_counter()
    zlib.crc32(src)
    out["crc32_gbps"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 2)
    path = os.path.join(workdir, "calibrate.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(src)
        f.flush()
        os.fsync(f.fileno())
    out["file_write_fsync_mbps"] = round(len(src) / (time.perf_counter() - t0) / 1e6, 1)
    os.unlink(path)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def _spawn_case(model: str, uri: str, opts: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = os.path.join(workdir, f"result-{model}-{uuid.uuid4().hex[:6]}.json")
    t0 = time.perf_counter()
    p = ctx.Process(target=run_case, args=(model, uri, opts, out))
    p.start()
    p.join(timeout)
    timed_out = p.is_alive()
    if timed_out:
        p.terminate()
        p.join(10)
    res: dict[str, Any] = {"model": model, "store": uri.split("://")[0]}
    if os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
    res["case_wall_s"] = round(time.perf_counter() - t0, 1)
    if timed_out:
        res["error"] = f"timed out after {timeout:.0f}s"
    elif p.exitcode == 3:
        res["error"] = "aborted by the memory guard (machine low on memory)"
    elif p.exitcode != 0:
        res.setdefault("error", f"child exit code {p.exitcode}")
    return res


def _g(d: dict[str, Any], *path: str, default: Any = None) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _med(first: float | None, more: list[float] | None) -> tuple[float, float] | None:
    samples = ([first] if first is not None else []) + list(more or [])
    if not samples:
        return None
    return statistics.median(samples), min(samples)


def summarize(case: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Derived per-case numbers: what is on the critical path, what runs in the background, share of a round."""
    ph = case.get("phases", {})
    gw, rw = ph.get("global_write", {}), ph.get("replica_write", {})
    if "write_total_s" not in gw or "write_total_s" not in rw:
        return {}
    rep = case.get("repeats", {})
    s: dict[str, Any] = {"global_bytes": gw["bytes"], "replica_bytes": rw["bytes"]}
    for key, first, more in (
            ("global_snapshot", _g(ph, "global_snapshot", "snapshot_s"), rep.get("global_snapshot_s")),
            ("replica_snapshot", _g(ph, "replica_snapshot", "snapshot_s"), rep.get("replica_snapshot_s")),
            ("global_write", gw["write_total_s"], rep.get("global_write_s")),
            ("replica_write", rw["write_total_s"], rep.get("replica_write_s"))):
        med, lo = _med(first, more)
        s[f"{key}_s"], s[f"{key}_min_s"] = round(med, 4), round(lo, 4)
    s["write_samples"] = 1 + len(rep.get("global_write_s", []))
    # Current runtime (replica.py _after_commit): every participant's save_fn (every committed round) +
    # replica snapshot (checkpoint rounds) block; writes are background. (Key names kept from the leader era.)
    s["critical_leader_every_round_s"] = s["global_snapshot_s"]
    s["critical_leader_ckpt_round_s"] = round(s["global_snapshot_s"] + s["replica_snapshot_s"], 4)
    s["critical_other_replicas_s"] = s["replica_snapshot_s"]
    s["background_leader_s"] = round(s["global_write_s"] + s["replica_write_s"], 4)
    conc = ph.get("concurrent_writes")
    if conc:
        s["background_leader_concurrent_s"] = max(conc["global_write_s"], conc["replica_write_s"])
    rounds = case.get("rounds")
    round_s = None
    if rounds:
        round_s = rounds["plain_round_s"]
        s["round_basis"] = (f"measured: {rounds['h']} inner steps of the causal-LM trainer "
                            f"({rounds['step_s']:.3f} s/step), median of {rounds['rounds_each']}")
        s["measured_checkpoint_round_s"] = rounds["checkpoint_round_s"]
        s["measured_global_only_round_s"] = rounds["global_only_round_s"]
        s["measured_checkpoint_overhead_pct"] = rounds["checkpoint_overhead_pct"]
        s["measured_global_only_overhead_pct"] = rounds["global_only_overhead_pct"]
        s["measured_replica_tail_s"] = rounds.get("checkpoint_replica_tail_s")
    elif case["model"] == "0.5b":
        round_s = opts["big_h"] * opts["big_step_s"]
        s["round_basis"] = (f"assumed: H={opts['big_h']} inner steps x {opts['big_step_s']} s/step "
                            f"({opts['big_step_note']})")
    else:
        s["round_basis"] = "n/a (no round assumption for this size)"
    if round_s:
        s["round_s"] = round(round_s, 4)
        s["critical_pct_of_round"] = round(100 * s["critical_leader_ckpt_round_s"] / round_s, 1)
        s["background_pct_of_round"] = round(100 * s["background_leader_s"] / round_s, 1)
        # The global upload is joined at the next start_quorum: what it takes beyond the H steps blocks there.
        s["global_upload_excess_s"] = round(max(0.0, s["global_write_s"] - round_s), 4)
    rd = ph.get("read", {})
    if "latest_checkpoint" in rd:
        s["launcher_resume_read_s"] = _g(rd, "latest_checkpoint", "wall_s")
        s["replica_startup_read_s"] = _g(rd, "replica_startup", "wall_s")
        s["launcher_resume_x"] = _g(rd, "latest_checkpoint", "x_needed")
        s["replica_startup_x"] = _g(rd, "replica_startup", "x_needed")
        s["verified"] = all(_g(rd, k, "verified", default=False) for k in ("load_global", "load_replica"))
    return s


def upload_rows(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Global-state bytes each replica uploads per committed round: old leader vs. each participant's slice."""
    sw = _g(case, "phases", "global_upload_by_w", default={})
    if "before" not in sw:
        return []
    before = sw["before"]
    rows = []
    for w in sorted(int(k) for k in sw if k.isdigit()):
        d = sw[str(w)]
        rows.append({"model": case["model"], "store": case["store"], "W": w,
                     "before_leader_mb": before["leader_bytes"] / MB, "before_others_mb": 0.0,
                     "after_max_mb": d["max_bytes"] / MB, "after_mean_mb": d["mean_bytes"] / MB,
                     "max_over_before": d["max_bytes"] / before["leader_bytes"],
                     "mean_over_before": d["mean_bytes"] / before["leader_bytes"],
                     "ideal": 1 / w, "before_wall_s": before["leader_wall_s"],
                     "after_slowest_wall_s": d["slowest_wall_s"],
                     "wall_ratio": d["slowest_wall_s"] / before["leader_wall_s"] if before["leader_wall_s"] else None,
                     "complete": d["complete"]})
    return rows


def resume_rows(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Bytes read at resume, after (this code) and before (951ee6d), as multiples of what is needed."""
    rd = _g(case, "phases", "read", default={})
    if "latest_checkpoint" not in rd:
        return []
    old = case.get("before_resume", {})
    rows = []
    for what, key, need in (("launcher resume: latest_checkpoint(verify=True)", "latest_checkpoint",
                             "checkpoint_bytes"),
                            ("replica startup (own state)", "replica_startup", "replica_needs_bytes")):
        after = rd[key]
        row = {"model": case["model"], "store": case["store"], "W": rd["world_size"], "what": what,
               "needed_mb": rd[need] / MB, "after_read_mb": after["bytes_read"] / MB, "after_x": after["x_needed"],
               "after_s": after.get("wall_s")}
        if key in old:
            row.update(before_needed_mb=old[need] / MB, before_read_mb=old[key]["bytes_read"] / MB,
                       before_x=old[key]["x_needed"], before_s=old[key]["wall_s"])
        else:
            row["before_note"] = old.get("skipped", "not measured")
        rows.append(row)
    if "replica_startup" in old:
        w = rd["world_size"]
        # Every replica starts up: the store serves W times one replica's startup reads.
        rows.append({"model": case["model"], "store": case["store"], "W": w,
                     "what": f"all {w} replicas' startups together", "needed_mb": w * rd["replica_needs_bytes"] / MB,
                     "after_read_mb": w * rd["replica_startup"]["bytes_read"] / MB,
                     "after_x": rd["replica_startup"]["x_needed"], "after_s": None,
                     "before_needed_mb": w * old["replica_needs_bytes"] / MB,
                     "before_read_mb": w * old["replica_startup"]["bytes_read"] / MB,
                     "before_x": old["replica_startup"]["x_needed"], "before_s": None})
    return rows


@dataclass
class Table:
    """One report table: printed with rich, and written as Markdown with ``--markdown``."""

    title: str
    columns: list[str]
    left: set[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def rich(self, con: Any) -> None:
        from rich.table import Table as RichTable

        t = RichTable(title=self.title)
        for col in self.columns:
            t.add_column(col, justify="left" if col in self.left else "right")
        for row in self.rows:
            t.add_row(*row)
        con.print(t)
        if self.note:
            con.print("  " + self.note)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def state_table(cases: list[dict[str, Any]]) -> Table:
    t = Table("Per state object, one replica (first write; seconds, MB)",
              ["model", "params", "store", "state", "MB", "snapshot", "encode", "store I/O", "write total",
               "peak +MB write", "read(verify)", "load", "get", "ok"], {"model", "store", "state"},
              note="snapshot = critical-path copy (global: torchft save_fn clone of the params; replica: "
              "replica._snapshot of AdamW state + data position + RNG). global = the whole state by one writer "
              "(write_global_shard of split_global_state(tree, 1)); replica = write_replica_state. "
              "store I/O = time inside the Store calls (put incl. framing, marker, exists; timed on a wrapper "
              "around the store object); encode = write total - store I/O (safetensors encode, crc32). "
              "peak +MB write = kernel VmHWM above the RSS at the start of the write (the snapshot being "
              "written is not included: add 1x). read(verify) = latest_checkpoint(verify=True) of the W-replica "
              "checkpoint (reads every object once); load = load_global / load_replica_at of one replica's startup, "
              "get = its time in Store.get (the rest is decode).")
    for c in cases:
        ph = c.get("phases", {})
        rd = ph.get("read", {})
        for state in ("global", "replica"):
            w, sn = ph.get(f"{state}_write", {}), ph.get(f"{state}_snapshot", {})
            head = [c["model"], f"{c.get('params', 0) / 1e6:.1f}M", c["store"], state]
            if "write_total_s" not in w:
                why = w.get("skipped") or sn.get("skipped") or c.get("error", "failed")
                t.rows.append(head + ["-"] * 9 + [why[:40]])
                continue
            r = rd.get(f"load_{state}", {})
            peak = w.get("peak_over_start_mb", 0.0)
            t.rows.append(head + [
                f"{w['bytes'] / MB:.1f}", _f(sn.get("snapshot_s")), _f(w.get("compute_s")), _f(w.get("store_io_s")),
                _f(w["write_total_s"]), f"{peak:.0f} ({peak * MB / max(1, w['bytes']):.1f}x)",
                _f(_g(rd, "latest_checkpoint", "wall_s")), _f(r.get("load_s")), _f(r.get("get_s")),
                {True: "yes", False: "NO"}.get(r.get("verified"), r.get("skipped", "-")[:20])])
    return t


def round_table(cases: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> Table:
    t = Table("Per round, current runtime: snapshots block, writes run in the background",
              ["model", "store", "global MB", "replica MB", "writes", "critical: ckpt round s",
               "critical: global-only round s", "background: W=1 s", "round s", "critical %", "background %",
               "measured ckpt round", "round"], {"model", "store", "round"},
              note="critical (every participant): ckpt round = save_fn clone + replica snapshot; global-only round "
              "= save_fn clone. background: W=1 = the whole global write + replica write (one participant holding "
              "all of the global state; with W participants its global part is ~1/W, see the upload table), "
              "sequential sum (and both at once where measured); must fit in a round, else the slice upload's "
              "excess blocks at the next sync. measured ckpt round (tiny) = a checkpoint round of participant 0 of "
              "W = --resume-w done as the runtime does it (replica write, then its slice) vs a plain round of H "
              "inner steps (medians, same process, 1 torch thread; the background work competes with training for "
              "this machine's cores). Medians over 'writes' samples per state. round = where the round's length "
              "comes from: " + "; ".join(f"{c['model']}/{c['store']}: {s['round_basis']}"
                                         for c, s in zip(cases, summaries) if s and "round_s" in s))
    for c, s in zip(cases, summaries):
        if not s:
            continue
        has = "round_s" in s
        meas = "-"
        if "measured_checkpoint_overhead_pct" in s:
            meas = (f"{s['measured_checkpoint_overhead_pct']:+.1f}% "
                    f"(global only {s['measured_global_only_overhead_pct']:+.1f}%)")
        bg = _f(s["background_leader_s"])
        if "background_leader_concurrent_s" in s:
            bg += f" ({_f(s['background_leader_concurrent_s'])} together)"
        t.rows.append([c["model"], c["store"], f"{s['global_bytes'] / MB:.1f}", f"{s['replica_bytes'] / MB:.1f}",
                       str(s["write_samples"]), _f(s["critical_leader_ckpt_round_s"]),
                       _f(s["critical_leader_every_round_s"]), bg, _f(s.get("round_s"), 2),
                       f"{s['critical_pct_of_round']:.1f}%" if has else "-",
                       f"{s['background_pct_of_round']:.1f}%" if has else "-", meas, s["round_basis"].split(":")[0]])
    return t


def upload_table(cases: list[dict[str, Any]]) -> Table:
    t = Table("Global-state upload per replica per committed round (MB): before = the leader uploads all, "
              "after = each participant its slice",
              ["model", "store", "W", "before: leader", "before: others", "after: max", "after: mean", "max/before",
               "mean/before", "1/W", "before s (leader)", "after s (slowest)", "slowest/before", "durable"],
              {"model", "store"},
              note="bytes = Store.bytes_written (framed blob + marker) of one Store object per simulated "
              "participant; participants run one after the other on this machine (wall = each one's own write). "
              "Slices are whole tensors (the tied embedding is ~27% of the 0.5B state), so the largest slice "
              "exceeds 1/W.")
    for c in cases:
        for r in upload_rows(c):
            t.rows.append([r["model"], r["store"], str(r["W"]), f"{r['before_leader_mb']:.1f}", "0",
                           f"{r['after_max_mb']:.1f}", f"{r['after_mean_mb']:.1f}", f"{r['max_over_before']:.3f}",
                           f"{r['mean_over_before']:.3f}", f"{r['ideal']:.3f}", f"{r['before_wall_s']:.3f}",
                           f"{r['after_slowest_wall_s']:.3f}", _f(r["wall_ratio"], 2),
                           "yes" if r["complete"] else "NO"])
    return t


def resume_table(cases: list[dict[str, Any]]) -> Table:
    t = Table("Resume read volume (Store.bytes_read of a fresh Store object), as a multiple of what is needed",
              ["model", "store", "W", "reader", "needed MB", "after MB", "after x", "after s", "before MB",
               "before x", "before s"], {"model", "store", "reader"},
              note="needed: launcher = the checkpoint's blobs (global slices + every replica state); replica = "
              f"global + its own state. before = the same checkpoint written and read by the {OLD_COMMIT} code "
              "(git show, loaded as a separate module): its replica startup ran latest_checkpoint(verify=True) "
              "(every object) then load_global and load_replica (again).")
    for c in cases:
        for r in resume_rows(c):
            t.rows.append([r["model"], r["store"], str(r["W"]), r["what"], f"{r['needed_mb']:.1f}",
                           f"{r['after_read_mb']:.1f}", f"{r['after_x']:.3f}", _f(r.get("after_s"), 2),
                           f"{r['before_read_mb']:.1f}" if "before_read_mb" in r else r.get("before_note", "-")[:30],
                           _f(r.get("before_x")), _f(r.get("before_s"), 2)])
    return t


def report_tables(cases: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> list[Table]:
    return [state_table(cases), upload_table(cases), resume_table(cases), round_table(cases, summaries)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mid,0.5b", help="comma-separated subset of tiny,mid,0.5b")
    ap.add_argument("--skip-big", action="store_true", help="skip the ~0.5B-param case")
    ap.add_argument("--skip-mid", action="store_true", help="skip the ~55M-param case")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 runs")
    ap.add_argument("--mid-s3", action="store_true", help="also run the ~55M case on moto S3 (~1 min)")
    ap.add_argument("--h", type=int, default=10, help="inner steps per round for the tiny model (spec default)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="tiny: rounds of each kind (plain, global-only, checkpoint) timed; 0 skips")
    ap.add_argument("--repeats", type=int, default=7, help="extra writes of small states (median/min reported)")
    ap.add_argument("--repeat-max-mb", type=float, default=100, help="repeat only states up to this size")
    ap.add_argument("--big-h", type=int, default=100, help="assumed inner steps per round for 0.5B")
    ap.add_argument("--big-step-s", type=float, default=0.5,
                    help="assumed H100 seconds per inner step for 0.5B (see docs/checkpoints.md)")
    ap.add_argument("--big-step-note", help="the reasoning behind --big-step-s, printed with it",
                    default="0.5B bf16, 64K tokens/step = 2.0e14 FLOP at ~40%% MFU of an "
                    "H100's 989 TFLOP/s")
    ap.add_argument("--tmp", default=None, help="scratch dir for the file:// store (needs ~9 GB with 0.5B)")
    ap.add_argument("--memory-floor-gb", type=float, default=1.0,
                    help="abort a case if machine-wide available memory falls below this")
    ap.add_argument("--world-sizes", default="2,4,8", help="participant counts W for the global-upload table")
    ap.add_argument("--resume-w", type=int, default=2,
                    help="replicas in the checkpoint used for the resume reads (and the timed rounds' W)")
    ap.add_argument("--case-timeout", type=float, default=2400,
                    help="seconds per file:// case (0.5B writes ~8 states of 4 GB and reads ~50 GB: ~15 min here)")
    ap.add_argument("--calibrate-mb", type=int, default=256,
                    help="MiB copied, checksummed and written for the machine-state line (a smoke run: a few)")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--markdown", default=None, help="also write the tables as Markdown to this file")
    args = ap.parse_args(argv)

    opts = {"h": args.h, "rounds": args.rounds, "repeats": args.repeats, "repeat_max_mb": args.repeat_max_mb,
            "big_h": args.big_h, "big_step_s": args.big_step_s, "big_step_note": args.big_step_note.replace("%%", "%"),
            "memory_floor_gb": args.memory_floor_gb,
            "world_sizes": sorted({int(w) for w in args.world_sizes.split(",") if w} | {args.resume_w}),
            "resume_w": args.resume_w}
    workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.tmp)
    models = [m for m in args.models.split(",") if m]
    if args.skip_mid:
        models = [m for m in models if m != "mid"]
    if args.skip_big:
        models = [m for m in models if m != "0.5b"]
    plan: list[tuple[str, str]] = [(m, "file") for m in ("tiny", "mid", "0.5b") if m in models]
    if not args.no_s3:
        plan += [(m, "s3") for m in ("tiny", "mid") if m in models and (m == "tiny" or args.mid_s3)]

    cases: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    calib = calibrate(workdir, mb=args.calibrate_mb)
    print(f"[checkpoint bench] machine now: {calib}", flush=True)
    try:
        for model, kind in [p for p in plan if p[1] == "file"]:
            uri = f"file://{workdir}/store-{model}"
            print(f"[checkpoint bench] {model} on file:// ...", flush=True)
            cases.append(_spawn_case(model, uri, opts, workdir, timeout=args.case_timeout))
            shutil.rmtree(f"{workdir}/store-{model}", ignore_errors=True)
            shutil.rmtree(f"{workdir}/store-{model}-old", ignore_errors=True)
        s3_plan = [p for p in plan if p[1] == "s3"]
        if s3_plan:
            from s3server import moto_s3_server, s3_environ

            for model, _ in s3_plan:
                # A fresh moto server per case: it keeps every object in memory.
                with moto_s3_server("ckpt-bench") as server, s3_environ(server):
                    print(f"[checkpoint bench] {model} on s3:// (moto, loopback) ...", flush=True)
                    cases.append(_spawn_case(model, f"s3://ckpt-bench/{model}", opts, workdir, timeout=600))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summaries = [summarize(c, opts) for c in cases]
    tables = report_tables(cases, summaries)
    con = Console(width=200)
    for table in tables:
        table.rich(con)
    import torch

    out = {
        "benchmark": "checkpoint",
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "loadavg_at_end": os.getloadavg(), "torch_threads": 1, "platform": platform.platform()},
        "options": opts,
        "calibration": calib,
        "assumptions": {"0.5b_round": f"H={args.big_h} x {args.big_step_s} s/step: {opts['big_step_note']}"},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "cases": [dict(c, summary=s) for c, s in zip(cases, summaries)],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json} ({out['wall_s']:.0f}s)")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Machine at the start: {calib}\n\n" + "\n".join(t.markdown() for t in tables))
        print(f"wrote {args.markdown}")
    return 0 if all("error" not in c for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())

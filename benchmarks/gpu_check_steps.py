#!/usr/bin/env python
"""The Python half of ``benchmarks/gpu_check.sh``: its report and the small steps of its stages.

The report (``gpu_check.json``) is rewritten atomically after every stage, so a stage killed by its timeout,
or the whole machine going away, leaves every row written before it. Each row: ``stage``, ``status``
(``ok`` | ``failed`` | ``timeout`` | ``skipped``), ``seconds`` (wall), ``started`` / ``finished`` (UTC,
ISO 8601) and ``t`` (Unix seconds at the end; increasing from row to row), ``timeout_s``, the stage's key
numbers, ``reason`` (why it was skipped) and ``error_tail`` (the end of its log when it failed or timed out).

    python benchmarks/gpu_check_steps.py init --json F --mode gpu --stages install,e2e-demo
    python benchmarks/gpu_check_steps.py row --json F --stage install --rc 0 --started T0 --timeout 60 \
        --log install.log --numbers install.json
    python benchmarks/gpu_check_steps.py versions --out F            # imports and versions (stage install)
    python benchmarks/gpu_check_steps.py save-model --shape tiny --out DIR
    python benchmarks/gpu_check_steps.py e2e --run URI --export DIR --device cpu --out F
    python benchmarks/gpu_check_steps.py rollout --result R.json --shape tiny --device cpu --out F \
        [--completions 4 --tokens 8]   # runs rollout_speed.py first, in this process
    python benchmarks/gpu_check_steps.py bench --result gpu.json --out F
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
#: Exit code by which a stage says "skipped" (its numbers file holds the reason).
SKIP_RC = 3
#: Exit codes of ``timeout`` (TERM sent; KILL sent after --kill-after).
TIMEOUT_RCS = (124, 137)
#: Characters of a stage's log kept in a row that is not ``ok``.
TAIL_CHARS = 2000
#: Packages whose versions every check records.
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "torchft", "datasets", "huggingface_hub",
             "pyarrow", "pydantic", "opentelemetry-sdk")


def _now() -> tuple[float, str]:
    t = time.time()
    return t, dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def _write(path: Path, report: dict[str, Any]) -> None:
    """Atomic rewrite (temp file + rename): a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def _read_json(path: Path | None) -> Any:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def cmd_init(a: argparse.Namespace) -> int:
    t, iso = _now()
    _write(a.json, {"check": "benchmarks/gpu_check.sh", "mode": a.mode, "started": iso, "t": t,
                    "stages": a.stages.split(","), "complete": False, "rows": []})
    return 0


def status_of(rc: int) -> str:
    """A stage's status from its exit code (``timeout``'s codes, :data:`SKIP_RC`, else ok/failed)."""
    if rc == 0:
        return "ok"
    if rc in TIMEOUT_RCS:
        return "timeout"
    return "skipped" if rc == SKIP_RC else "failed"


def cmd_row(a: argparse.Namespace) -> int:
    report = _read_json(a.json) or {"rows": []}
    t, iso = _now()
    status = a.status or status_of(a.rc)
    numbers = _read_json(a.numbers)
    numbers = numbers if isinstance(numbers, dict) else {}
    reason = numbers.pop("reason", None) or a.reason
    row: dict[str, Any] = {"stage": a.stage, "status": status, "seconds": round(t - a.started, 3),
                           "started": dt.datetime.fromtimestamp(a.started, dt.timezone.utc)
                           .isoformat(timespec="milliseconds"),
                           "finished": iso, "t": t, "timeout_s": a.timeout, "rc": a.rc}
    if reason:
        row["reason"] = reason
    row.update(numbers)
    if status in ("failed", "timeout") and a.log is not None and a.log.is_file():
        row["error_tail"] = a.log.read_text(errors="replace")[-TAIL_CHARS:]
    report["rows"].append(row)
    _write(a.json, report)
    extra = f" ({reason})" if reason else ""
    print(f"[gpu-check] {a.stage}: {status} in {row['seconds']:.1f}s{extra}", flush=True)
    return 0


def cmd_finish(a: argparse.Namespace) -> int:
    report = _read_json(a.json)
    report["complete"] = True
    report["finished"] = _now()[1]
    _write(a.json, report)
    bad = [r["stage"] for r in report["rows"] if r["status"] in ("failed", "timeout")]
    print(f"[gpu-check] wrote {a.json}: " + ", ".join(f"{r['stage']} {r['status']}" for r in report["rows"]))
    return 1 if bad else 0


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def wheel_listing(folder: Path) -> dict[str, Any]:
    """What ``gpu_wheels.sh`` left in ``folder``: wheel count and MiB, and the top-level requirements of its
    ``requirements.txt`` that no wheel there provides (``wheels_missing``; a pinned one needs that version)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = sorted(folder.glob("*.whl"))
    have: dict[str, set[str]] = {}
    for w in wheels:
        name, version, _, _ = parse_wheel_filename(w.name)
        have.setdefault(canonicalize_name(name), set()).add(str(version))
    missing = []
    req_file = folder / "requirements.txt"
    for line in req_file.read_text().splitlines() if req_file.is_file() else []:
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            found = have.get(canonicalize_name(req.name), set())
            if not any(req.specifier.contains(v, prereleases=True) for v in found):
                missing.append(line.strip())
    return {"wheels": len(wheels), "wheels_mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 1),
            "wheels_missing": missing}


def cmd_versions(a: argparse.Namespace) -> int:
    """Import what a replica imports (torchft pulls in OpenTelemetry) and record the versions and the device."""
    import composer_cloud.replica  # noqa: F401
    import datasets  # noqa: F401
    import torch
    import torchft  # noqa: F401
    import trl  # noqa: F401

    numbers: dict[str, Any] = {"versions": versions(), "python": sys.version.split()[0],
                               "cuda_available": torch.cuda.is_available(),
                               "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if a.wheels is not None:
        numbers.update(wheel_listing(a.wheels))
        if numbers["wheels_missing"]:
            print(f"no wheel in {a.wheels} for {numbers['wheels_missing']}: run bash benchmarks/gpu_wheels.sh again",
                  file=sys.stderr)
            return 1
    if a.reason:
        numbers["reason"] = a.reason
    a.out.write_text(json.dumps(numbers))
    print(json.dumps(numbers, indent=1))
    return 0


def cmd_save_model(a: argparse.Namespace) -> int:
    """A Qwen2.5-shaped model with random weights (``gpu.py``'s shapes) and the built-in tokenizer, as a folder
    ``[model] name`` can point at. Stored in bfloat16 (half the bytes; a LoRA base is bf16 anyway)."""
    import torch

    sys.path.insert(0, str(BENCH))
    from gpu import build_model

    from composer_cloud.model import build_tokenizer

    model = build_model(a.shape, lora=False, device=torch.device("cpu"))
    model.to(torch.bfloat16).save_pretrained(a.out)
    build_tokenizer().save_pretrained(a.out)
    a.numbers.write_text(json.dumps({"model_params": sum(p.numel() for p in model.parameters()),
                                     "model_shape": a.shape}))
    return 0


def round_times(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Round wall times (s) of a run's committed round rows: per round, the slowest replica's ``wall_s``."""
    by_round: dict[int, list[float]] = {}
    for r in rows:
        if r.get("kind", "round") == "round" and r.get("wall_s") is not None:
            by_round.setdefault(int(r["round"]), []).append(float(r["wall_s"]))
    rounds = [max(v) for _, v in sorted(by_round.items())]
    sync = [float(r["sync_s"]) for r in rows if r.get("sync_s") is not None]
    return {"rounds": len(rounds), "round_s": [round(x, 3) for x in rounds],
            "round_s_median": round(statistics.median(rounds), 3) if rounds else None,
            "sync_s_median": round(statistics.median(sync), 3) if sync else None,
            "replicas": len({r.get("rank") for r in rows})}


def cmd_e2e(a: argparse.Namespace) -> int:
    """The end-to-end stage's last steps: ``composer-cloud export`` of the run into ``--export``, round times from
    the run's metrics, and the export loaded by transformers (one forward pass on ``--device``). Fails (exit 1) when the export does not load or computes non-finite
    logits, or when fewer than ``--expect-rounds`` rounds are in the metrics."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_cloud.cli import main as cli_main
    from composer_cloud.runs.metrics import read_metrics
    from composer_cloud.storage.run import open_run

    # `composer-cloud export RUN --out DIR`, the command itself, in this process (one interpreter start less).
    argv, sys.argv = sys.argv, ["composer-cloud", "export", a.run, "--out", str(a.export)]
    try:
        cli_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    if code != 0:
        print(f"composer-cloud export {a.run} exited {code}", file=sys.stderr)
        return 1
    rows = read_metrics(open_run(a.run).store, kind="round")  # what `composer-cloud metrics --kind round` shows
    numbers = {"run": a.run, **round_times(rows), **(_read_json(a.base) or {})}
    t0 = time.perf_counter()
    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.export).to(device)
    tok = AutoTokenizer.from_pretrained(a.export)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        logits = model(ids).logits
    numbers.update(export_load_s=round(time.perf_counter() - t0, 3),
                   export_params=sum(p.numel() for p in model.parameters()),
                   export_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                   export_logits_finite=bool(torch.isfinite(logits).all()))
    if device.type == "cuda":
        numbers["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    a.out.write_text(json.dumps(numbers))
    print(json.dumps(numbers, indent=1))
    if numbers["rounds"] < a.expect_rounds:
        print(f"only {numbers['rounds']} of {a.expect_rounds} rounds in the metrics of {a.run}", file=sys.stderr)
        return 1
    return 0 if numbers["export_logits_finite"] else 1


def _rollout_rows(result: Any) -> dict[str, dict[str, Any]]:
    """``{mode: row}`` from ``rollout_speed.py``'s JSON: a ``rows`` list (or ``modes`` dict) of objects with a
    mode name (``rollout`` / ``mode``) and ``tokens_per_s``."""
    if not isinstance(result, dict):
        return {}
    if isinstance(result.get("modes"), dict):
        return {k: v for k, v in result["modes"].items() if isinstance(v, dict)}
    out = {}
    for r in result.get("rows", []) if isinstance(result.get("rows"), list) else []:
        if isinstance(r, dict):
            name = r.get("rollout") or r.get("mode")
            if name:
                out[str(name)] = r
    return out


def cmd_rollout(a: argparse.Namespace) -> int:
    """The fast-rollout row: tokens/s and MFU of ``hf`` and ``hf-fast`` from ``rollout_speed.py``'s JSON, and
    their ratio. MFU = ``2 N`` FLOPs per generated token x tokens/s / the GPU's dense bf16 peak (``gpu.py``'s
    table; none on a CPU), ``N`` as in ``gpu.py`` (``generation_params``), when the result does not give it.
    With ``--completions``/``--tokens``, ``rollout_speed.py`` itself runs first, in this process (one
    interpreter start less: torch and transformers are imported once), and writes ``--result``."""
    import torch

    sys.path.insert(0, str(BENCH))
    from gpu import build_model, generation_params, peak_flops

    if a.completions is not None:
        import rollout_speed

        rc = rollout_speed.main(["--shape", a.shape, "--device", a.device, "--completions", str(a.completions),
                                 "--tokens", str(a.tokens), "--out", str(a.result)])
        if rc != 0:
            return rc
    result = _read_json(a.result)
    if result is None:
        print(f"{a.result}: rollout_speed.py wrote no JSON", file=sys.stderr)
        return 1
    modes = _rollout_rows(result)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" and torch.cuda.is_available() else "cpu"
    peak = peak_flops(name)
    n = generation_params(build_model(a.shape, lora=False, device=torch.device("meta")))
    numbers: dict[str, Any] = {"shape": a.shape, "device_name": name, "peak_flops": peak, "params_n": n,
                               "result": result}
    for mode in ("hf", "hf-fast"):
        r = modes.get(mode)
        if r is None or r.get("tokens_per_s") is None:
            continue
        tps = float(r["tokens_per_s"])
        numbers[f"{mode}_tokens_per_s"] = round(tps, 2)
        mfu = r.get("mfu")
        numbers[f"{mode}_mfu"] = mfu if mfu is not None else (2 * n * tps / peak if peak else None)
    if numbers.get("hf_tokens_per_s") and numbers.get("hf-fast_tokens_per_s"):
        numbers["fast_vs_hf"] = round(numbers["hf-fast_tokens_per_s"] / numbers["hf_tokens_per_s"], 3)
    a.out.write_text(json.dumps(numbers))
    print(json.dumps({k: v for k, v in numbers.items() if k != "result"}, indent=1))
    return 0 if "hf_tokens_per_s" in numbers else 1


def cmd_bench(a: argparse.Namespace) -> int:
    """The ``gpu.py`` stage's numbers from its (incremental) JSON: every row it wrote, and a summary: step time
    vs plain TRL, each rollout mode's tokens/s and MFU, peak memory full vs LoRA, the sync share at H = 50."""
    result = _read_json(a.result)
    if result is None:
        a.out.write_text(json.dumps({"rows_written": 0}))
        return 0
    keep = ("shape", "mode", "rollout", "impl", "step_s", "rollout_s", "train_s", "peak_mem_gib", "tokens_per_s",
            "mfu", "rollout_tokens_per_s", "rollout_mfu", "vs_trl", "vs_trl_anchor", "sync_s", "sync_share_h50",
            "store_mib_per_round", "synced_mib")
    rows = [{k: r.get(k) for k in keep} for r in result.get("rows", [])]
    numbers = {"device_name": result.get("device"), "peak_flops": result.get("peak_flops"),
               "complete": result.get("complete", False), "rows_written": len(rows), "rows": rows}
    a.out.write_text(json.dumps(numbers))
    print(json.dumps({k: v for k, v in numbers.items() if k != "rows"}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("init")
    s.add_argument("--json", type=Path, required=True)
    s.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    s.add_argument("--stages", required=True)
    s = sub.add_parser("row")
    s.add_argument("--json", type=Path, required=True)
    s.add_argument("--stage", required=True)
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--status", choices=["ok", "failed", "timeout", "skipped"])
    s.add_argument("--reason")
    s.add_argument("--started", type=float, required=True, help="Unix seconds the stage started")
    s.add_argument("--timeout", type=float)
    s.add_argument("--log", type=Path)
    s.add_argument("--numbers", type=Path)
    s = sub.add_parser("finish")
    s.add_argument("--json", type=Path, required=True)
    s = sub.add_parser("versions")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--wheels", type=Path, help="also list the carried wheels (gpu_wheels.sh's folder)")
    s.add_argument("--reason")
    s = sub.add_parser("save-model")
    s.add_argument("--shape", required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--numbers", type=Path, required=True)
    s = sub.add_parser("e2e")
    s.add_argument("--run", required=True)
    s.add_argument("--export", type=Path, required=True)
    s.add_argument("--device", default="cpu")
    s.add_argument("--expect-rounds", type=int, default=1)
    s.add_argument("--base", type=Path, help="save-model's numbers, when the run started from a saved model")
    s.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("rollout")
    s.add_argument("--result", type=Path, required=True)
    s.add_argument("--shape", required=True)
    s.add_argument("--device", default="cpu")
    s.add_argument("--completions", type=int, help="run rollout_speed.py first (with --tokens), writing --result")
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("bench")
    s.add_argument("--result", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    handlers = {"init": cmd_init, "row": cmd_row, "finish": cmd_finish, "versions": cmd_versions,
                "save-model": cmd_save_model, "e2e": cmd_e2e, "rollout": cmd_rollout, "bench": cmd_bench}
    return handlers[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())

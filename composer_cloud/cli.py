"""The ``composer-cloud`` command line.

Exit codes: 0 success (for ``launch``/``resume``: the run completed), 1 the run
failed or was cancelled, 2 bad input (nothing was written to the store).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from composer_cloud.jobs import ExecutorError, JobHandle, assign_ranks, get_executor
from composer_cloud.rendezvous.store import Store, StoreConfigError, StoreError, join_uri
from composer_cloud.run import load_handles, request_cancel, run_status, save_handles, summarize
from composer_cloud.spec import RunSpec, SpecError, load_spec, spec_from_dict

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="DiLoCo post-training across independent serverless jobs, synced through an object store.")
console = Console()
err_console = Console(stderr=True)
logger = logging.getLogger(__name__)


class BadInput(Exception):
    """Raised for user errors: printed and mapped to exit code 2."""


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def _normalize_uri(uri: str) -> str:
    """Accept plain local paths where a run URI is expected."""
    return uri if "://" in uri else f"file://{Path(uri).resolve()}"


def _open_run(run_uri: str) -> tuple[Store, RunSpec]:
    from composer_cloud.replica import open_run

    run_uri = _normalize_uri(run_uri)
    try:
        return open_run(run_uri)
    except StoreConfigError as exc:
        raise _fail(str(exc)) from None
    except StoreError as exc:
        raise _fail(f"{run_uri} is not a composer-cloud run ({exc})") from None
    except SpecError as exc:
        raise _fail(str(exc)) from None


# ---------------------------------------------------------------- launch
def _build_spec(config: Optional[Path], overrides: dict[str, Any]) -> RunSpec:
    try:
        spec = load_spec(config, overrides).with_run_id()
        assign_ranks(spec.executor, spec.replicas)
        return spec
    except (SpecError, ValueError) as exc:
        raise _fail(str(exc)) from None


def _check_store(spec: RunSpec) -> Store:
    try:
        root = Store(spec.store, storage_options=spec.store_options)
        root.check_access()
        return Store(join_uri(root.uri, spec.run_id), storage_options=spec.store_options)
    except StoreConfigError as exc:
        raise _fail(f"store: {exc}") from None


def _launch_replicas(store: Store, spec: RunSpec, ranks: list[int] | None = None) -> list[JobHandle]:
    handles: list[JobHandle] = []
    for name, assigned in assign_ranks(spec.executor, spec.replicas):
        todo = [r for r in assigned if ranks is None or r in ranks]
        if not todo:
            continue
        executor = get_executor(name, spec)
        launched = executor.launch(store.uri, todo)
        save_handles(store, launched)
        handles.extend(launched)
    return handles


@app.command()
def launch(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="run spec TOML")] = None,
    executor: Annotated[Optional[str], typer.Option(help="local | modal | hf-jobs | mix like local:1,hf-jobs:1")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="number of replica jobs")] = None,
    min_replicas: Annotated[Optional[int], typer.Option(help="fewest replicas a round may commit with")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="DiLoCo rounds (outer steps)")] = None,
    inner_steps: Annotated[Optional[int], typer.Option(help="inner steps per round (H)")] = None,
    store: Annotated[Optional[str], typer.Option(help="store URI: file://DIR or s3://bucket/prefix")] = None,
    run_id: Annotated[Optional[str], typer.Option(help="run id (default: generated)")] = None,
    trainer: Annotated[Optional[str], typer.Option(help="three-channel | causal-lm")] = None,
    codec: Annotated[Optional[str], typer.Option(help="wire codec: fp32 | bf16 | int8")] = None,
    model: Annotated[Optional[str], typer.Option(help="'tiny', a Hugging Face model id or a local path")] = None,
    max_restarts: Annotated[Optional[int], typer.Option(help="restarts of a replica that dies (local: supervisor; hf-jobs: attempts; modal: retries)")] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    gpu: Annotated[Optional[str], typer.Option(help="Modal GPU type, e.g. H100")] = None,
    flavor: Annotated[Optional[str], typer.Option(help="HF Jobs flavor, e.g. a10g-large")] = None,
    detach: Annotated[bool, typer.Option(help="return once the jobs are launched")] = False,
    dry_run: Annotated[bool, typer.Option(help="print what would be launched; launch nothing")] = False,
) -> None:
    """Launch a new run (with no flags: 2 local CPU replicas, tiny model, store under ./runs/)."""
    spec = _build_spec(config, {
        "executor": executor, "replicas": replicas, "min_replicas": min_replicas, "rounds": rounds,
        "inner_steps": inner_steps, "store": store, "run_id": run_id, "trainer.name": trainer,
        "sync.codec": codec, "model.name": model, "max_restarts": max_restarts, "seed": seed,
        "modal.gpu": gpu, "hf_jobs.flavor": flavor,
    })
    if dry_run:
        _print_plan(spec)
        return
    run = _check_store(spec)
    # Write-once: two launches racing on one run id cannot both start.
    if run.exists("spec.json") or not run.create_json("spec.json", spec.to_json_dict()):
        raise _fail(f"run {run.uri} already exists; continue it with `composer-cloud resume {run.uri}`")
    try:
        _launch_replicas(run, spec)
    except (ExecutorError, StoreError) as exc:
        raise _fail(f"launch failed: {exc}", code=1) from None
    console.print(f"launched [bold]{spec.replicas}[/] replicas of run [bold]{spec.run_id}[/] → {run.uri}")
    if detach:
        console.print(f"follow with: composer-cloud status {run.uri}")
        return
    raise typer.Exit(_watch(run, spec))


def _print_plan(spec: RunSpec) -> None:
    run_uri = join_uri(spec.store, spec.run_id)
    plans = []
    for name, ranks in assign_ranks(spec.executor, spec.replicas):
        try:
            plans.append(get_executor(name, spec).plan(run_uri, ranks))
        except (ExecutorError, ValueError) as exc:
            raise _fail(str(exc)) from None
    for p in plans:
        table = Table(title=f"{p.executor}: ranks {p.ranks}", show_header=False)
        table.add_row("image", p.image)
        table.add_row("command", " ".join(p.command))
        table.add_row("env vars", ", ".join(p.env_names) or "-")
        table.add_row("secrets (names)", ", ".join(p.secret_names) or "-")
        table.add_row("gpu", p.gpu)
        table.add_row("est. GPU-hours", "-" if p.estimated_gpu_hours is None else f"{p.estimated_gpu_hours:.2f}")
        for note in p.notes:
            table.add_row("note", note)
        console.print(table)
    console.print(f"run {run_uri}: {spec.rounds} rounds x {spec.inner_steps} inner steps (dry run: nothing launched)")


def _status_table(status: Any) -> Table:
    table = Table(title=f"{status.run_id}: {status.state} — round {status.rounds_committed}/{status.rounds}")
    for col in ("rank", "executor", "state", "round", "restarts", "message"):
        table.add_column(col)
    for r in status.replicas:
        table.add_row(str(r.rank), r.executor, r.state, "-" if r.last_round is None else str(r.last_round),
                      str(r.restarts), (r.message or "").strip().splitlines()[-1][:80] if r.message else "")
    return table


def _watch(run: Store, spec: RunSpec) -> int:
    """Follow a run until every replica job has finished; print the summary. Returns the exit code."""
    status = run_status(run, spec)
    try:
        with Live(_status_table(status), console=console, refresh_per_second=2, transient=False) as live:
            while status.state == "running":
                time.sleep(1.0)
                status = run_status(run, spec)
                live.update(_status_table(status))
    except KeyboardInterrupt:
        console.print("interrupted: cancelling the run's jobs")
        _cancel(run, spec)
        status = run_status(run, spec)
    _print_summary(run, spec, status)
    return 0 if status.state == "completed" else 1


def _print_summary(run: Store, spec: RunSpec, status: Any) -> None:
    s = summarize(run, spec, status)
    table = Table(title=f"run {spec.run_id}: {status.state}", show_header=False)
    table.add_row("rounds committed", f"{s.rounds_committed}/{spec.rounds}")
    if s.loss_first is not None:
        table.add_row("train loss (first → last round)", f"{s.loss_first:.4f} → {s.loss_last:.4f}")
    if s.reward_first is not None:
        table.add_row("mean reward (first → last round)", f"{s.reward_first:.3f} → {s.reward_last:.3f}")
    if s.eval_loss_first is not None:
        table.add_row("held-out loss (first → last round)", f"{s.eval_loss_first:.4f} → {s.eval_loss_last:.4f}")
    total = s.compute_s + s.sync_s
    if total > 0:
        table.add_row("time in inner steps / syncing", f"{s.compute_s:.1f}s / {s.sync_s:.1f}s "
                                                         f"({100 * s.sync_s / total:.1f}% syncing, all replicas)")
    table.add_row("store bytes moved (sync)", f"{s.bytes_moved / 1e6:.1f} MB")
    if s.lost_replicas:
        table.add_row("lost replicas", ", ".join(map(str, s.lost_replicas)))
    table.add_row("run URI", run.uri)
    console.print(table)


# ---------------------------------------------------------------- status / logs / cancel
@app.command()
def status(run_uri: str, as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False) -> None:
    """Show a run's state, committed rounds and replicas."""
    run, spec = _open_run(run_uri)
    st = run_status(run, spec)
    if as_json:
        sys.stdout.write(json.dumps(st.to_json(), indent=2) + "\n")
    else:
        console.print(_status_table(st))


@app.command()
def logs(run_uri: str, replica: Annotated[Optional[int], typer.Option(help="only this rank")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f")] = False) -> None:
    """Print replica logs (from the executor that runs them)."""
    run, spec = _open_run(run_uri)
    handles = [h for h in load_handles(run) if replica is None or h.rank == replica]
    if not handles:
        raise _fail(f"no replica {replica} in run {run.uri}" if replica is not None else "run has no replicas")
    for h in handles:
        ex = get_executor(h.executor, spec)
        for line in ex.logs(h, follow=follow):
            sys.stdout.write((f"[r{h.rank}] " if replica is None else "") + line + "\n")
            sys.stdout.flush()


def _cancel(run: Store, spec: RunSpec) -> None:
    request_cancel(run)
    for h in load_handles(run):
        try:
            get_executor(h.executor, spec).cancel(h)
        except Exception as exc:  # noqa: BLE001 - cancel the others anyway
            err_console.print(f"could not cancel replica {h.rank} ({h.executor} {h.job_id}): {exc}")


@app.command()
def cancel(run_uri: str) -> None:
    """Cancel every replica job of a run."""
    run, spec = _open_run(run_uri)
    _cancel(run, spec)
    console.print(f"cancelled run {spec.run_id}")


# ---------------------------------------------------------------- resume / export
@app.command()
def resume(
    run_uri: str,
    executor: Annotated[Optional[str], typer.Option(help="run the remaining rounds elsewhere")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="a different replica count")] = None,
    detach: Annotated[bool, typer.Option()] = False,
) -> None:
    """Continue a run from its latest valid checkpoint."""
    from composer_cloud import checkpoint as ckpt

    run, spec = _open_run(run_uri)
    updates: dict[str, Any] = {}
    if executor is not None:
        updates["executor"] = executor
    if replicas is not None:
        updates["replicas"] = replicas
        updates["min_replicas"] = min(spec.min_replicas, replicas)
    try:
        new_spec = spec_from_dict(spec.to_json_dict() | updates, source="resume flags")
        assign_ranks(new_spec.executor, new_spec.replicas)
    except (SpecError, ValueError) as exc:
        raise _fail(str(exc)) from None
    # Stop whatever is left of the previous launch before touching its rounds.
    for h in load_handles(run):
        try:
            get_executor(h.executor, spec).cancel(h)
        except Exception as exc:  # noqa: BLE001
            err_console.print(f"warning: could not cancel replica {h.rank} of the previous launch: {exc}")
    latest = ckpt.latest_checkpoint(run)
    from_round = latest.round if latest else -1
    ckpt.discard_after(run, from_round)
    run.delete("control/cancel.json")
    run.delete("executor", recursive=True)
    run.delete("replicas", recursive=True)
    run.put_json("spec.json", new_spec.to_json_dict())
    n = len(run.list_dirs("resumes"))
    run.put_json(f"resumes/{n}.json", {"from_round": from_round, "time": time.time(), "executor": new_spec.executor,
                                       "replicas": new_spec.replicas})
    console.print(f"resuming {spec.run_id} from " + (f"checkpoint {from_round}" if latest else "the start"))
    _launch_replicas(run, new_spec)
    if detach:
        return
    raise typer.Exit(_watch(run, new_spec))


@app.command()
def export(run_uri: str, out: Annotated[Path, typer.Option("--out", help="output directory")],
           round: Annotated[Optional[int], typer.Option("--round", help="checkpoint round (default latest)")] = None
           ) -> None:
    """Write the global parameters as a Hugging Face model directory."""
    from composer_cloud.export import export_model

    run, spec = _open_run(run_uri)
    try:
        r = export_model(run, spec, out, round=round)
    except (LookupError, StoreError) as exc:
        raise _fail(str(exc), code=1) from None
    console.print(f"exported round {r} of {spec.run_id} to {out}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()

"""The ``composer-cloud`` command line: a thin typer layer over :mod:`composer_cloud.runs`.

Exit codes: 0 success (for ``launch``/``resume``: the run completed), 1 the run
failed or was cancelled, 2 bad input (nothing was written to the store).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from composer_cloud import runs
from composer_cloud.jobs import get_executor
from composer_cloud.rendezvous.store import StoreConfigError, StoreError, join_uri
from composer_cloud.runs import LaunchError, Run, RunExists, RunNotFound, RunStatus
from composer_cloud.spec import RunSpec, SpecError

app = typer.Typer(add_completion=True, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="DiLoCo post-training across independent serverless jobs, synced through an object store.")
console = Console(soft_wrap=True)  # URIs stay on one line (copy-paste, grep)
err_console = Console(stderr=True, soft_wrap=True)
logger = logging.getLogger(__name__)

StoreOptionFlag = Annotated[Optional[list[str]], typer.Option(
    "--store-option", help="fsspec storage option KEY=VALUE needed to reach the store (e.g. endpoint_url=...); "
                           "repeatable. Default: $COMPOSER_CLOUD_STORE_OPTIONS")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Map the library's errors to exit codes: bad input 2, a failed launch 1. No tracebacks."""
    try:
        yield
    except (SpecError, StoreConfigError, RunNotFound, RunExists) as exc:
        raise _fail(str(exc)) from None
    except LaunchError as exc:
        raise _fail(str(exc), code=1) from None
    except StoreError as exc:
        raise _fail(f"store error: {exc}", code=1) from None


def _storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _fail(f"--store-option {pair!r}: use KEY=VALUE")
        options[key] = value
    return options


def _open(run_uri: str, store_option: list[str] | None) -> Run:
    with _user_errors():
        return runs.open_run(run_uri, storage_options=_storage_options(store_option))


def _version(value: bool) -> None:
    if value:
        from composer_cloud import __version__

        console.print(f"composer-cloud {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """DiLoCo post-training across independent serverless jobs, synced through an object store."""


@app.command()
def doctor(store: Annotated[str, typer.Argument(help="store URI (s3://bucket/prefix, file:///dir, ...)")],
           store_option: StoreOptionFlag = None) -> None:
    """Check that a store provides what a run needs (write-once create, read/list-after-write, delete).

    Exit 0: it does; 2: it does not (the failing properties are named) or cannot be reached.
    """
    from composer_cloud.rendezvous.conformance import format_report, probe_store

    with _user_errors():
        report = probe_store(runs.normalize_run_uri(store), storage_options=_storage_options(store_option))
    console.print(format_report(report), highlight=False)
    if not report.ok:
        raise typer.Exit(2)


@app.command("ls")
def list_runs(store: Annotated[str, typer.Argument(help="store URI or local path")] = "file://./runs",
              as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
              store_option: StoreOptionFlag = None) -> None:
    """List the runs under a store: id, state, rounds."""
    with _user_errors():
        found = runs.list_runs(store, storage_options=_storage_options(store_option))
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in found], indent=2) + "\n")
        return
    table = Table(title=f"runs under {store}")
    for col in ("run id", "state", "rounds", "uri"):
        table.add_column(col)
    for r in found:
        table.add_row(r.run_id, r.state, f"{r.rounds_committed}/{r.rounds}", r.uri)
    console.print(table)


# ---------------------------------------------------------------- launch
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
    overrides = {
        "executor": executor, "replicas": replicas, "min_replicas": min_replicas, "rounds": rounds,
        "inner_steps": inner_steps, "store": store, "run_id": run_id, "trainer.name": trainer,
        "sync.codec": codec, "model.name": model, "max_restarts": max_restarts, "seed": seed,
        "modal.gpu": gpu, "hf_jobs.flavor": flavor,
    }
    with _user_errors():
        spec = runs.build_spec(config=config, overrides=overrides)
        if dry_run:
            _print_plan(spec, runs.plan(spec))
            return
        run = runs.launch(spec, base_dir=config.resolve().parent if config is not None else None)
    console.print(f"launched [bold]{spec.replicas}[/] replicas of run [bold]{spec.run_id}[/] → {run.uri}")
    if detach:
        console.print(f"follow with: composer-cloud status {run.uri}")
        return
    raise typer.Exit(_watch(run))


def _print_plan(spec: RunSpec, plans: list[Any]) -> None:
    for p in plans:
        table = Table(title=f"{p.executor}: ranks {p.ranks}", show_header=False)
        table.add_row("image", p.image)
        table.add_row("command", " ".join(p.command))
        table.add_row("env vars", ", ".join(p.env_names) or "-")
        table.add_row("secrets (names)", ", ".join(p.secret_names) or "-")
        table.add_row("gpu", p.gpu)
        table.add_row("est. GPU-hours", "-" if p.estimated_gpu_hours is None else f"{p.estimated_gpu_hours:.2f}")
        if p.hourly_cost_usd is not None:
            table.add_row("cost per hour (all jobs)", f"${p.hourly_cost_usd:,.2f}")
        if p.estimated_cost_usd is not None:
            table.add_row("cost if every job runs to its timeout", f"${p.estimated_cost_usd:,.2f}")
        if p.max_cost_usd is not None:
            table.add_row("cost upper bound (restarts included)", f"${p.max_cost_usd:,.2f}")
        table.add_row("price source", p.cost_basis or "-")
        for note in p.notes:
            table.add_row("note", note)
        console.print(table)
    run_uri = join_uri(spec.store, spec.run_id)
    console.print(f"run {run_uri}: {spec.rounds} rounds x {spec.inner_steps} inner steps (dry run: nothing launched)")


def _status_table(status: RunStatus) -> Table:
    table = Table(title=f"{status.run_id}: {status.state} — round {status.rounds_committed}/{status.rounds}")
    for col in ("rank", "executor", "state", "round", "restarts", "message"):
        table.add_column(col)
    for r in status.replicas:
        table.add_row(str(r.rank), r.executor, r.state, "-" if r.last_round is None else str(r.last_round),
                      str(r.restarts), (r.message or "").strip().splitlines()[-1][:80] if r.message else "")
    notes = [*status.problems, *status.warnings] + ([f"store unreachable, showing the last known state: {status.store_error}"]
                                  if status.store_error else [])
    if notes:
        table.caption = "\n".join(notes)
    return table


def _watch(run: Run) -> int:
    """Follow a run until every replica job has finished; print the summary. Returns the exit code."""
    with _user_errors():
        status = runs.get_status(run)
    try:
        with Live(_status_table(status), console=console, refresh_per_second=2, transient=False) as live:
            status = runs.wait(run, on_update=lambda st: live.update(_status_table(st)))
    except KeyboardInterrupt:
        console.print("interrupted: cancelling the run's jobs")
        _report_cancel(runs.cancel(run))
        status = runs.get_status(run)
    console.line()
    _print_summary(run, status)
    return 0 if status.state == "completed" else 1


def _print_summary(run: Run, status: RunStatus) -> None:
    s = runs.summarize(run, status)
    table = Table(title=f"run {run.run_id}: {status.state}", show_header=False)
    table.add_row("rounds committed", f"{s.rounds_committed}/{run.spec.rounds}")
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
def status(run_uri: str, as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
           store_option: StoreOptionFlag = None) -> None:
    """Show a run's state, committed rounds and replicas."""
    run = _open(run_uri, store_option)
    with _user_errors():
        st = runs.get_status(run)
    if as_json:
        sys.stdout.write(json.dumps(st.to_json(), indent=2) + "\n")
    else:
        console.print(_status_table(st))


@app.command()
def logs(run_uri: str, replica: Annotated[Optional[int], typer.Option(help="only this rank")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f")] = False, store_option: StoreOptionFlag = None) -> None:
    """Print replica logs (from the executor that runs them)."""
    run = _open(run_uri, store_option)
    handles = [h for h in runs.load_handles(run.store) if replica is None or h.rank == replica]
    if not handles:
        raise _fail(f"no replica {replica} in run {run.uri}" if replica is not None else "run has no replicas")
    for h in handles:
        ex = get_executor(h.executor, run.spec)
        for line in ex.logs(h, follow=follow):
            sys.stdout.write((f"[r{h.rank}] " if replica is None else "") + line + "\n")
            sys.stdout.flush()


def _report_cancel(result: runs.CancelResult) -> None:
    for warning in result.warnings:
        err_console.print(f"could not cancel {warning}", highlight=False)


@app.command()
def cancel(run_uri: str, store_option: StoreOptionFlag = None) -> None:
    """Cancel every replica job of a run."""
    run = _open(run_uri, store_option)
    with _user_errors():
        result = runs.cancel(run)
    if result.noop:
        console.print(result.noop)
        return
    _report_cancel(result)
    console.print(f"cancelled run {run.run_id}" + (f" (ranks {result.cancelled})" if result.warnings else ""))
    if result.warnings:
        raise typer.Exit(1)


# ---------------------------------------------------------------- resume / export
@app.command()
def resume(
    run_uri: str,
    executor: Annotated[Optional[str], typer.Option(help="run the remaining rounds elsewhere")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="a different replica count")] = None,
    detach: Annotated[bool, typer.Option()] = False,
    store_option: StoreOptionFlag = None,
) -> None:
    """Continue a run from its latest valid checkpoint."""
    run = _open(run_uri, store_option)
    with _user_errors():
        result = runs.resume(run, executor=executor, replicas=replicas)
    if result.noop:
        console.print(result.noop)
        return
    for warning in result.warnings:
        err_console.print(f"warning: {warning}", highlight=False)
    console.print(f"resuming {run.run_id} from "
                  + (f"the end of round {result.from_round + 1}/{run.spec.rounds}" if result.from_round >= 0
                     else "the start"))
    if detach:
        return
    raise typer.Exit(_watch(result.run))


@app.command()
def export(run_uri: str, out: Annotated[Path, typer.Option("--out", help="output directory")],
           round: Annotated[Optional[int], typer.Option("--round", help="checkpoint round (default latest)")] = None,
           store_option: StoreOptionFlag = None) -> None:
    """Write the global parameters as a Hugging Face model directory."""
    from composer_cloud.export import export_model

    run = _open(run_uri, store_option)
    if out.exists() and not out.is_dir():
        raise _fail(f"--out {out} is an existing file; give a directory (new or empty)")
    try:
        r = export_model(run, out, round=round)
    except (LookupError, StoreError) as exc:
        raise _fail(str(exc), code=1) from None
    console.print(f"exported {run.run_id} after round {r + 1}/{run.spec.rounds} to {out}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()

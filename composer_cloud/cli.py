"""The ``composer-cloud`` command line: a thin typer layer over :mod:`composer_cloud.runs`.

Exit codes: 0 success (for ``launch``/``resume`` attached, ``wait`` and ``status --wait``: the run
completed), 1 the run failed or was cancelled, 2 bad input (nothing was written to the store), 130
Ctrl-C on an attached ``launch``/``resume`` (detached: the run goes on). Plain ``status``: 0 running,
not started or completed, 1 failed or cancelled.

Every command that reads or reports something takes ``--json`` (one JSON
document on stdout; ``logs --json``: one JSON object per line).
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
from rich.markup import escape

from composer_cloud import cli_args, cli_views, runs
from composer_cloud.cli_watch import follow, follow_to_end
from composer_cloud.errors import ConfigError, LaunchError, StoreError, redact
from composer_cloud.round_numbers import round_index, shown_round
from composer_cloud.runs import Run
from composer_cloud.spec import DEFAULT_STORE

app = typer.Typer(add_completion=True, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="DiLoCo post-training across independent serverless jobs, synced through an object store.")
console = Console(soft_wrap=True)  # URIs stay on one line (copy-paste, grep)
err_console = Console(stderr=True, soft_wrap=True)
logger = logging.getLogger(__name__)

JsonFlag = Annotated[bool, typer.Option("--json", help="machine-readable output (JSON on stdout)")]
SetFlag = Annotated[Optional[list[str]], typer.Option(
    "--set", help="any spec setting KEY=VALUE, dotted for nested ones (sync.codec=bf16, inner_optimizer.lr=1e-4); "
                  "VALUE is JSON or TOML (numbers, true/false, lists) or else a string; repeatable")]
StoreOptionFlag = Annotated[Optional[list[str]], typer.Option(
    "--store-option", help="fsspec storage option KEY=VALUE needed to reach the store (e.g. endpoint_url=...); "
                           "repeatable. Default: $COMPOSER_CLOUD_STORE_OPTIONS")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {escape(redact(message))}", highlight=False)
    return typer.Exit(code)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Map the library's errors to exit codes: bad input 2, a failed launch 1. No tracebacks."""
    try:
        yield
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except LaunchError as exc:
        raise _fail(str(exc), code=1) from None
    except StoreError as exc:
        raise _fail(f"store error: {exc}", code=1) from None


def _storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    try:
        return cli_args.storage_options(pairs)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _set_overrides(pairs: list[str] | None) -> dict[str, Any]:
    try:
        return cli_args.set_overrides(pairs)
    except ValueError as exc:
        raise _fail(str(exc)) from None


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
def doctor(store: Annotated[Optional[str], typer.Argument(help="store URI (s3://bucket/prefix, file:///dir, ...)")] = None,
           executor: Annotated[Optional[list[str]], typer.Option(
               help="also check this executor's SDK and credentials: local | modal | hf-jobs (repeatable)")] = None,
           as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Check a store (write-once create, read/list-after-write, delete) and an executor's credentials.

    Exit 0: everything checked is fine; 2: something is not (each failure says what to do).
    """
    from composer_cloud.runs.doctor import check_credentials
    from composer_cloud.storage.conformance import format_report, probe_store

    if store is None and not executor:
        raise _fail("give a store URI, an --executor, or both (e.g. composer-cloud doctor s3://bucket/x --executor modal)")
    options = _storage_options(store_option)
    checks = check_credentials(executor or [], store or "", options)
    report = None
    if store is not None and all(c.ok for c in checks if c.name.startswith("s3 store")):
        from composer_cloud.runs.lifecycle import leaves_no_new_folders

        uri = runs.normalize_run_uri(store)
        if uri.startswith("file://") and not Path(uri[7:]).exists():  # probed in a folder removed again
            err_console.print(f"note: {uri[7:]} does not exist (yet); `launch` would create it", highlight=False)
        with _user_errors(), leaves_no_new_folders(uri):  # `doctor file:///typo` must not create the typo
            report = probe_store(uri, storage_options=options)
    ok = all(c.ok for c in checks) and (report is None or report.ok)
    if as_json:
        _print_json({**(dataclasses.asdict(report) if report else {}),
                     "credentials": [dataclasses.asdict(c) for c in checks], "ok": ok})
    else:
        cli_views.print_checks(console, checks)
        if report is not None:
            console.print(format_report(report), highlight=False)
    if not ok:
        raise typer.Exit(2)


@app.command("ls")
def list_runs(store: Annotated[str, typer.Argument(help="store URI or local path")] = DEFAULT_STORE,
              as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """List the runs under a store: id, state, rounds committed, age (newest first)."""
    with _user_errors():
        found = runs.list_runs(store, storage_options=_storage_options(store_option))
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in found], indent=2) + "\n")
        return
    table = cli_views.runs_table(runs.normalize_run_uri(store), found)
    console.print(table)
    if found:
        console.print(f"details: composer-cloud status {found[0].uri}", highlight=False)


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
    codec: Annotated[Optional[str], typer.Option(help="wire codec: fp32 | bf16 | int8 | sparse (SparseLoCo top-k "
                                                      "with error feedback, docs/sparse.md)")] = None,
    model: Annotated[Optional[str], typer.Option(help="'tiny', a Hugging Face model id or a local path")] = None,
    max_restarts: Annotated[Optional[int], typer.Option(help="restarts of a replica that dies (local: supervisor; hf-jobs: attempts; modal: retries)")] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    gpu: Annotated[Optional[str], typer.Option(help="Modal GPU type, e.g. H100")] = None,
    flavor: Annotated[Optional[str], typer.Option(help="HF Jobs flavor, e.g. a10g-large")] = None,
    gpus_per_replica: Annotated[Optional[int], typer.Option(
        help="GPUs (local ranks) per replica job, 1-8: Modal GPU:N, the HF Jobs xN flavor")] = None,
    parallelism: Annotated[Optional[str], typer.Option(
        help="how a replica's local ranks hold the model: ddp (replicated) | fsdp (sharded)")] = None,
    set_: SetFlag = None,
    store_option: StoreOptionFlag = None,
    detach: Annotated[bool, typer.Option(help="return once the jobs are launched")] = False,
    dry_run: Annotated[bool, typer.Option(help="print what would be launched; launch nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable: the plan (--dry-run), the launch, "
                                                          "and (attached) the final status")] = False,
) -> None:
    """Launch a new run (with no flags: 2 local CPU replicas, tiny model, store under ./runs/).

    Attached (the default) it shows live progress until the run ends; Ctrl-C
    detaches (the run goes on; `composer-cloud cancel` stops it).
    """
    flags = {
        "executor": executor, "replicas": replicas, "min_replicas": min_replicas, "rounds": rounds,
        "inner_steps": inner_steps, "store": store, "run_id": run_id, "trainer.name": trainer,
        "sync.codec": codec, "model.name": model, "max_restarts": max_restarts, "seed": seed,
        "modal.gpu": gpu, "hf_jobs.flavor": flavor, "gpus_per_replica": gpus_per_replica,
        "parallelism": parallelism,
    }
    # Named flags win over --set for the same key (they are the more specific spelling).
    overrides = {**_set_overrides(set_), **{k: v for k, v in flags.items() if v is not None}}
    if store_option:  # the spec's store_options (the replicas get them too): --store-option, as other commands take
        overrides["store_options"] = {**overrides.get("store_options", {}), **(_storage_options(store_option) or {})}
    base_dir = config.resolve().parent if config is not None else None
    with _user_errors():
        spec = runs.build_spec(config=config, overrides=overrides)
        from composer_cloud.runs.lifecycle import launch_warnings

        for warning in launch_warnings(spec, given=overrides):
            err_console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
        if dry_run:  # launch's own checks (runs.check_launch), then the executors' credentials
            from composer_cloud.runs.doctor import spec_credentials

            checked = runs.check_launch(spec, base_dir=base_dir)
            failed = cli_views.dry_run_report(console, checked, spec_credentials(checked.spec), as_json=as_json)
            if failed:
                raise _fail("launch would fail: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
            return
        try:
            run = runs.launch(spec, base_dir=base_dir)
        except KeyboardInterrupt as exc:  # Ctrl-C before launch returned: say what was left, and what to do
            raise _interrupted(exc, as_json=as_json) from None
    launched = {"run_id": spec.run_id, "run_uri": run.uri, "replicas": spec.replicas}
    if as_json:
        if detach:
            _print_json(launched)
            return
        raise typer.Exit(_watch(run, as_json=launched))
    console.print(f"launched [bold]{spec.replicas}[/] replicas of run [bold]{spec.run_id}[/] → {run.uri}")
    if detach:
        console.print(f"follow with: composer-cloud status {run.uri}")
        return
    raise typer.Exit(_watch(run))


def _interrupted(exc: KeyboardInterrupt, *, as_json: bool) -> typer.Exit:
    """Ctrl-C during ``launch`` before it returned: one line saying what is left (exit 130)."""
    line, out = cli_views.interrupted(exc)
    err_console.print(line, highlight=False)
    if as_json:
        _print_json(out)
    return typer.Exit(130)


DETACHED = "detached: the run continues; cancel with: composer-cloud cancel {uri}; follow with: composer-cloud status {uri}"


def _watch(run: Run, *, as_json: dict[str, Any] | None = None) -> int:
    """Follow a run until every replica job has finished; print the summary. Returns the exit code.

    Ctrl-C detaches: the jobs keep running (local replicas run in their own
    sessions, so the terminal's SIGINT does not reach them) and the message
    says how to cancel or follow the run.
    """
    try:
        with _user_errors():
            status = follow(run, console=None if as_json is not None else console)
    except KeyboardInterrupt:
        err_console.print(DETACHED.format(uri=run.uri), highlight=False)
        if as_json is not None:
            _print_json({**as_json, "detached": True})
        return 130
    try:  # the run has ended: a Ctrl-C now stops only the printing (one line, not a traceback)
        if as_json is not None:
            _print_json({**as_json, "status": cli_views.status_json(status),
                         "summary": dataclasses.asdict(runs.summarize(run, status))})
        else:
            console.line()
            cli_views.print_summary(console, err_console, run, status)
        if run.spec.report_to:  # the spec's trackers, from the store's metrics, on this machine
            _write_tracking(run, list(run.spec.report_to), Path("tracking"), "composer-cloud",
                            quiet=as_json is not None)
    except KeyboardInterrupt:
        err_console.print(f"interrupted after the run ended ({status.state.value}); its summary: composer-cloud "
                          f"status {run.uri}", highlight=False)
        return 130
    return 0 if status.state == runs.RunState.COMPLETED else 1


def _write_tracking(run: Run, report_to: list[str], logdir: Path, project: str, *, quiet: bool = False) -> Any:
    from composer_cloud.runs.tracking import write_tracking

    try:
        result = write_tracking(run, report_to=report_to, logdir=logdir, project=project)
    except (ValueError, ImportError) as exc:
        raise _fail(str(exc)) from None
    if not quiet:
        console.print(cli_views.tracking_line(result, logdir, project), highlight=False)
    return result


# ---------------------------------------------------------------- status / logs / cancel
#: ``status``/``wait`` exit codes by the run's state (documented in README.md and the commands' help).
STATE_EXIT = {s: int(s in (runs.RunState.FAILED, runs.RunState.CANCELLED, runs.RunState.UNREADABLE)) for s in runs.RunState}


@app.command()
def status(run_uri: str, as_json: JsonFlag = False, store_option: StoreOptionFlag = None,
           wait_: Annotated[bool, typer.Option("--wait", help="follow the run until it ends; exit with its "
                                                              "outcome (as `composer-cloud wait`)")] = False) -> None:
    """Show a run's state, committed rounds, progress (step, loss, reward, steps/s, elapsed, ETA) and replicas.
    Exit codes: 0 running, not started or completed; 1 failed or cancelled; 2 no such run or bad input
    (--wait: 0 completed, 1 failed or cancelled, 130 Ctrl-C: the run goes on)."""
    if wait_:
        raise typer.Exit(_wait_for(run_uri, as_json=as_json, store_option=store_option))
    run = _open(run_uri, store_option)
    with _user_errors():
        st = runs.get_status(run)
    if as_json:
        sys.stdout.write(json.dumps(cli_views.status_json(st), indent=2) + "\n")
    else:
        console.print(cli_views.status_table(st))
    raise typer.Exit(STATE_EXIT.get(st.state, 1))


@app.command("wait")
def wait_cmd(run_uri: str, as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Follow a run until it ends and exit with its outcome: 0 completed, 1 failed or cancelled, 2 no such
    run, 130 Ctrl-C (the run goes on). A run that is not started exits 1 at once (`resume` starts it)."""
    raise typer.Exit(_wait_for(run_uri, as_json=as_json, store_option=store_option))


def _wait_for(run_uri: str, *, as_json: bool, store_option: list[str] | None) -> int:
    run = _open(run_uri, store_option)
    with _user_errors():
        return follow_to_end(run, console=console, err_console=err_console, as_json=as_json)


@app.command()
def logs(run_uri: str,
         replica: Annotated[Optional[list[int]], typer.Option(help="only this rank (repeatable)")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until every job ended")] = False,
         tail: Annotated[Optional[int], typer.Option("--tail", "-n", help="last N lines of each replica")] = None,
         since: Annotated[Optional[str], typer.Option(help="lines since a duration ago (10m, 2h) or an ISO time")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line: rank, line, time")] = False,
         verbose: Annotated[bool, typer.Option("--verbose", "-v", help="also the libraries' INFO/DEBUG lines "
                                                                        "(torchft, transformers, ...)")] = False,
         samples: Annotated[bool, typer.Option(help="each round's sample completions, prompt and reward")] = False,
         store_option: StoreOptionFlag = None) -> None:
    """Print the replicas' logs: all replicas merged by time, each line prefixed with its rank (r0, r1, ...).

    By default composer-cloud's own lines (steps, rounds, checkpoints), every warning and error, and tracebacks;
    --verbose adds the libraries' chatter. --samples: each round's sample completions (trainer.log_samples)."""
    from composer_cloud.runs.logs import parse_since, replica_logs, without_rank

    run = _open(run_uri, store_option)
    if tail is not None and tail < 0:
        raise _fail("--tail must be >= 0")
    if samples:  # the store's samples/ objects (cli_views.print_samples); --since and --follow do not apply
        raise typer.Exit(cli_views.print_samples(run, ranks=replica, tail=tail, as_json=as_json))
    ranks = {h.rank for h in runs.load_handles(run.store)}
    if not ranks or (replica and not set(replica) <= ranks):
        raise _fail(f"no replica {sorted(set(replica or []) - ranks)} in run {run.uri} (ranks: {sorted(ranks)})"
                    if ranks else "the run has no replica jobs recorded")
    try:
        since_t = parse_since(since) if since else None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    errors: list[str] = []
    try:
        for ll in replica_logs(run, ranks=replica, follow=follow, tail=tail, since=since_t, errors=errors,
                               verbose=verbose):
            sys.stdout.write((json.dumps(ll.to_json()) if as_json else f"[r{ll.rank}] {without_rank(ll.line)}") + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    for e in errors:
        err_console.print(f"could not read logs of {escape(str(e))}", highlight=False)
    raise typer.Exit(1 if errors else 0)


@app.command()
def metrics(run_uri: str,
            replica: Annotated[Optional[int], typer.Option(help="only this rank")] = None,
            kind: Annotated[Optional[str], typer.Option(help="step | round (table default: round)")] = None,
            csv: Annotated[bool, typer.Option("--csv", help="CSV on stdout")] = False,
            as_json: Annotated[bool, typer.Option("--json", help="a JSON array of rows")] = False,
            all_: Annotated[bool, typer.Option("--all", help="include rows a resume or restart superseded")] = False,
            store_option: StoreOptionFlag = None) -> None:
    """Per-step and per-round metrics of every replica (from the store's metrics/ objects)."""
    from composer_cloud.runs.metrics import to_csv

    if kind not in (None, "step", "round"):
        raise _fail(f"--kind {kind!r}: use step or round")
    if csv and as_json:
        raise _fail("give --csv or --json, not both")
    run = _open(run_uri, store_option)
    with _user_errors():
        rows = runs.read_metrics(run.store, rank=replica, kind=kind or (None if csv or as_json else "round"),
                                 superseded=all_)
    if not rows:  # say why, not an empty line: the run has not trained yet, or it failed before it did
        with _user_errors():
            st = runs.get_status(run)
        why = "; ".join(cli_views.reason_lines(st)[:3])
        err_console.print(f"no {kind or ('round' if not (csv or as_json) else '')} metrics rows".replace("  ", " ")
                          + f" in run {run.run_id}: it is {st.state}" + (f" ({why})" if why else ""),
                          highlight=False, soft_wrap=False)
        if as_json:
            _print_json(rows)
        raise typer.Exit(STATE_EXIT.get(st.state, 1))
    if as_json:
        _print_json(rows)
    elif csv:
        sys.stdout.write(to_csv(rows))
    else:
        console.print(cli_views.metrics_table(run.run_id, rows, kind))


@app.command()
def report(run_uri: str, out: Annotated[Optional[Path], typer.Option(
               "--out", help="output directory (default: report/ in a local run's folder, else ./<run_id>-report)")] = None,
           as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Write report.png and report.html: train loss per inner step; reward, held-out eval, sync time per round;
    one line per replica (dead or restarted replicas marked)."""
    from composer_cloud.runs.report import ReportUnavailable, write_report

    run = _open(run_uri, store_option)
    try:
        with _user_errors():
            rep = write_report(run, out)
    except ReportUnavailable as exc:
        raise _fail(str(exc)) from None
    if as_json:
        _print_json({"run_id": run.run_id, "png": str(rep.png), "html": str(rep.html), "rounds": rep.rounds,
                     "replicas": rep.replicas, "labels": rep.labels,
                     "rollouts": None if rep.fleet is None else dataclasses.asdict(rep.fleet)})
    else:
        console.print(f"wrote {rep.png} and {rep.html} ({rep.rounds} rounds, replicas {rep.replicas})")


def _report_cancel(result: runs.CancelResult) -> None:
    for warning in result.warnings:
        err_console.print(f"could not cancel {escape(warning)}", highlight=False)


@app.command()
def cancel(run_uri: str, as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Cancel every replica job of a run."""
    run = _open(run_uri, store_option)
    with _user_errors():
        result = runs.cancel(run)
    if as_json:
        _print_json({"run_id": run.run_id, "run_uri": run.uri, "cancelled": result.cancelled,
                     "warnings": result.warnings, "noop": result.noop})
        if result.warnings:
            raise typer.Exit(1)
        return
    if result.noop:
        console.print(result.noop)
        return
    _report_cancel(result)
    console.print(f"cancel requested for run {run.run_id}; no job was stopped" if not result.cancelled else
                  f"cancelled run {run.run_id}" + (f" (ranks {result.cancelled})" if result.warnings else ""))
    if result.warnings:
        raise typer.Exit(1)


@app.command()
def init(path: Annotated[Path, typer.Argument(help="where to write the spec")] = Path("composer-cloud.toml"),
         force: Annotated[bool, typer.Option("--force", help="overwrite an existing file")] = False) -> None:
    """Write a starter run spec: every setting at its default (the trainer's keys as comments)."""
    from composer_cloud.runs.starter import starter_spec

    if path.exists() and not force:
        raise _fail(f"{path} exists; pass --force to overwrite it, or give another path")
    path.write_text(starter_spec())
    console.print(f"wrote {path}; check it with: composer-cloud launch --config {path} --dry-run", highlight=False)


@app.command("rm")
def remove(run_uri: str, force: Annotated[bool, typer.Option("--force", help="cancel a running run first")] = False,
           as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Delete a run: every object under its URI and this machine's record of its run key (irreversible;
    `export` first what you want to keep). A running run needs --force."""
    run = _open(run_uri, store_option)
    with _user_errors():
        result = runs.remove(run, force=force)
    if as_json:
        _print_json(dataclasses.asdict(result))
        return
    console.print(f"removed run {run.run_id} ({run.uri})" + ("; its run key record too" if result.key_removed else ""),
                  highlight=False)


# ---------------------------------------------------------------- resume / export
@app.command()
def resume(
    run_uri: str,
    executor: Annotated[Optional[str], typer.Option(help="run the remaining rounds elsewhere")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="a different replica count")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="extend the run to N rounds (lock-step, bitwise)")] = None,
    force: Annotated[bool, typer.Option("--force", help="resume a running run (its replicas restart from the checkpoint)")] = False,
    detach: Annotated[bool, typer.Option(help="return once the jobs are launched")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable: what resumed, and (attached) the "
                                                          "final status")] = False,
    store_option: StoreOptionFlag = None,
) -> None:
    """Continue a run from its latest valid checkpoint (attached: Ctrl-C detaches, the run goes on)."""
    run = _open(run_uri, store_option)
    with _user_errors():
        try:
            result = runs.resume(run, executor=executor, replicas=replicas, force=force, rounds=rounds)
        except KeyboardInterrupt:
            err_console.print(f"interrupted while resuming: `composer-cloud status {run.uri}` says what runs (not "
                              f"started: resume it again); cancel with: composer-cloud cancel {run.uri}",
                              highlight=False)
            raise typer.Exit(130) from None
    if as_json:
        out = {"run_id": run.run_id, "run_uri": run.uri, **cli_views.resume_point_json(run.spec, result.from_round),
               "ranks": [h.rank for h in result.handles], "warnings": result.warnings, "noop": result.noop}
        if result.noop or detach:
            _print_json(out)
            return
        raise typer.Exit(_watch(result.run, as_json=out))
    if result.noop:
        console.print(result.noop)
        return
    for warning in result.warnings:
        err_console.print(f"warning: {escape(warning)}", highlight=False)
    console.print(f"resuming {run.run_id} from " + cli_views.resume_point(run.spec, result.from_round))
    if detach:
        return
    raise typer.Exit(_watch(result.run))


@app.command()
def export(run_uri: str, out: Annotated[Path, typer.Option("--out", help="output directory")],
           round: Annotated[Optional[int], typer.Option("--round", help="round to export, counted from 1 as "
                                                        "everywhere (default: the latest checkpoint)")] = None,
           adapter: Annotated[bool, typer.Option("--adapter", help="LoRA run: the adapter alone (PEFT format)")] = False,
           push_to_hub: Annotated[Optional[str], typer.Option(help="then upload it to this Hub model repo")] = None,
           as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Write the global parameters as a Hugging Face model directory with a model card, from the store alone."""
    from composer_cloud.runs.export import export_model
    from composer_cloud.runs.hub import check_repo_id, push_folder

    run, created = _open(run_uri, store_option), not out.exists()
    try:  # bad input: exit 2, nothing created
        if round is not None:
            round_index(round)  # ValueError naming --round: rounds are counted from 1
        check_repo_id(push_to_hub), cli_args.writable_dir(out)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    try:
        r = export_model(run, out, round=None if round is None else round_index(round), adapter=adapter)
        exported = cli_views.exported_point(run.spec, r)
        hub = push_folder(out, push_to_hub, commit_message=f"{run.run_id}, {exported}") if push_to_hub else None
    except (LookupError, StoreError, RuntimeError) as exc:
        if created and out.exists() and not any(out.iterdir()):
            out.rmdir()  # a refused export leaves nothing behind
        raise _fail(str(exc), code=1) from None
    if as_json:
        where = {"version": r} if run.spec.sync.mode == "decoupled" else {"round": shown_round(r)}
        return _print_json({"run_id": run.run_id, **where, "out": str(out.resolve()), "hub": hub})
    console.print(f"exported {run.run_id} {exported} to {out}{f'; pushed: {hub}' * bool(hub)}")


@app.command()
def track(run_uri: str,
          to: Annotated[list[str], typer.Option("--to", help="tracker: tensorboard | trackio | wandb | mlflow "
                                                "(repeatable; TRL's report_to names)")],
          logdir: Annotated[Path, typer.Option(help="TensorBoard log directory (one folder per run)")] = Path("tracking"),
          project: Annotated[str, typer.Option(help="trackio/wandb project, MLflow experiment")] = "composer-cloud",
          as_json: JsonFlag = False, store_option: StoreOptionFlag = None) -> None:
    """Write a run's metrics to TensorBoard, trackio, wandb or MLflow: one series per replica, plus the rounds."""
    run = _open(run_uri, store_option)
    with _user_errors():
        result = _write_tracking(run, to, logdir, project, quiet=as_json)
    if as_json:
        _print_json(dataclasses.asdict(result))


@app.command()
def pairs(
    trace: Annotated[str, typer.Argument(help="trace of states: JSON Lines {prompt, student_action, meta} (path or URI)")],
    teachers: Annotated[str, typer.Option("--teachers", help="TOML file of [[teacher]] tables (endpoint, model, "
                                          "api_key_env, input_price/output_price in USD per 1M tokens)")],
    out: Annotated[str, typer.Option("--out", help="pairs JSONL to write (path or URI): what trainer.pairs reads")],
    max_cost: Annotated[float, typer.Option("--max-cost", help="USD the command may spend at most (hard ceiling)")],
    threshold: Annotated[float, typer.Option(help="fraction of teachers that must agree")] = 2 / 3,
    concurrency: Annotated[int, typer.Option(help="requests in flight at once")] = 8,
    filters: Annotated[Optional[list[str]], typer.Option("--filter", help="pair filter KEY=VALUE: min_chars, "
                       "max_chars, min_words, max_words, max_special_ratio (none: off); repeatable")] = None,
    report_path: Annotated[Optional[str], typer.Option("--report", help="also write the report as JSON here")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay a trace against teacher models and write the preference pairs channel 3 trains on."""
    from composer_cloud.trainer.three_channel import teachers as tm

    empty: tm.NoPairsError | None = None
    try:
        try:
            report = tm.make_teacher_pairs(tm.load_trace(trace), tm.load_teachers(teachers), out=out,
                                           max_cost_usd=max_cost, threshold=threshold, concurrency=concurrency,
                                           filters=tm.parse_filters(filters))
        except tm.NoPairsError as exc:  # what was asked and spent is still worth seeing; nothing was written
            empty, report = exc, exc.report
        if report_path:
            tm.write_report(report_path, report)
    except tm.TeachersError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        _print_json(report.to_json())
    else:
        console.print(tm.report_table(report))
    if empty is not None:
        raise _fail(str(empty), code=1)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()

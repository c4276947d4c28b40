"""What the ``composer-cloud`` command line prints (rich tables), apart from the commands themselves."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from composer_cloud import runs
from composer_cloud.runs import Run, RunState, RunStatus
from composer_cloud.round_numbers import shown_round
from composer_cloud.runs.status import RolloutFleet, exit_reason
from composer_cloud.spec import RunSpec
from composer_cloud.storage.store import join_uri


def age(since: float | None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d`` since an epoch time; ``-`` when unknown."""
    if since is None:
        return "-"
    s = max(0.0, time.time() - since)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def print_plan(console: Console, spec: RunSpec, plans: list[Any],
               training: list[tuple[str, str]] | None = None) -> None:
    """``launch --dry-run``: the training plan (what the replicas will train, resolved as they resolve it), then
    one table per executor (image, command, GPUs, price), then the run's URI and its work."""
    if training:
        table = Table(title="training plan", show_header=False)
        for label, value in training:
            table.add_row(label, escape(value))
        console.print(table)
    for p in plans:
        role = ""
        if spec.rollouts.workers:  # the workers are job ranks after the replicas, planned like them
            role = " (rollout workers)" if set(p.ranks) <= set(spec.worker_ranks) else " (trainer replicas)"
        table = Table(title=f"{p.executor}: ranks {p.ranks}{role}", show_header=False)
        table.add_row("image", p.image)
        table.add_row("command", " ".join(p.command))
        table.add_row("env vars", ", ".join(p.env_names) or "-")
        table.add_row("secrets (names)", ", ".join(p.secret_names) or "-")
        table.add_row("gpu", p.gpu)
        table.add_row("GPUs per replica", f"{p.gpus_per_replica} ({spec.gpus_per_replica} local rank"
                      f"{'s' if spec.gpus_per_replica != 1 else ''}, {spec.parallelism})")
        table.add_row("est. GPU-hours", "-" if p.estimated_gpu_hours is None else f"{p.estimated_gpu_hours:.2f}")
        if p.replica_hour_cost_usd is not None:
            table.add_row("cost per replica-hour", f"${p.replica_hour_cost_usd:,.2f}")
        if p.hourly_cost_usd is not None:
            table.add_row(f"cost per hour ({len(p.ranks)} replica{'s' if len(p.ranks) != 1 else ''})",
                          f"${p.hourly_cost_usd:,.2f}")
        if p.estimated_cost_usd is not None:
            table.add_row("cost if every job runs to its timeout", f"${p.estimated_cost_usd:,.2f}")
        if p.max_cost_usd is not None:
            table.add_row("cost upper bound (restarts included)", f"${p.max_cost_usd:,.2f}")
        table.add_row("price source", p.cost_basis or "-")
        for note in p.notes:
            table.add_row("note", note)
        console.print(table)
    run_uri = join_uri(spec.store, spec.run_id)
    console.print(f"run {run_uri}: {work_budget(spec)} (dry run: nothing launched)", highlight=False)


def work_budget(spec: RunSpec) -> str:
    """A run's work as people count it: lock-step ``4 rounds x 10 inner steps``; decoupled, the fleet's
    contribution budget (``replicas x rounds`` contributions of ``inner_steps`` steps), never rounds."""
    if spec.sync.mode == "decoupled":
        return (f"a budget of {spec.replicas * spec.rounds} contributions ({spec.replicas} replicas x {spec.rounds})"
                f" of {spec.inner_steps} inner steps each, merged as they arrive")
    return f"{spec.rounds} rounds x {spec.inner_steps} inner steps"


def resume_point(spec: RunSpec, from_round: int) -> str:
    """Where ``resume`` continues from (``from_round``: the 0-based checkpoint, -1: the start; decoupled: the
    global version): ``the end of round 2/4``, ``global version 5``, ``the start``."""
    if from_round < 0:
        return "the start"
    if spec.sync.mode == "decoupled":
        return f"global version {from_round}"
    return f"the end of round {shown_round(from_round)}/{spec.rounds}"


def resume_point_json(spec: RunSpec, from_round: int) -> dict[str, int | None]:
    """``resume --json``'s position, named for what it counts: ``after_round`` (lock-step, counted from 1;
    null: from the start) or ``from_version`` (decoupled: the global version; null: from the start)."""
    if spec.sync.mode == "decoupled":
        return {"from_version": None if from_round < 0 else from_round}
    return {"after_round": None if from_round < 0 else shown_round(from_round)}


def exported_point(spec: RunSpec, position: int) -> str:
    """What ``export`` wrote, as people count it: ``after round 2/4``; decoupled: ``global version 5``."""
    if spec.sync.mode == "decoupled":
        return f"global version {position}"
    return f"after round {shown_round(position)}/{spec.rounds}"


def print_summary(console: Console, err_console: Console, run: Run, status: RunStatus) -> None:
    s = runs.summarize(run, status)
    table = Table(title=f"run {run.run_id}: {status.state}", show_header=True)
    table.add_column("")
    if run.spec.sync.mode == "decoupled":  # contributions and merges against the fleet's budget, never rounds
        table.add_column("first contribution → last (mean over replicas)")
        table.add_row("contributions, merges", progress_title(status).partition(" — ")[2])
    else:
        table.add_column("first round → last round (mean over replicas)")
        table.add_row("rounds committed", f"{s.rounds_committed}/{run.spec.rounds}")
    if s.loss_first is not None:
        table.add_row(f"train loss: {s.loss_name}", f"{s.loss_first:.4f} → {s.loss_last:.4f}")
    for c in s.channels:
        table.add_row(f"  {c.name}", f"{c.first:.4f} → {c.last:.4f}")
    if s.reward_first is not None:
        table.add_row("mean reward", f"{s.reward_first:.3f} → {s.reward_last:.3f}")
    for key, (first, last) in s.diagnosis.items():  # the diagnosis short of grad_norm = 0 (the trainer's DIAGNOSIS)
        fmt = ".1f" if "length" in key else ".2f"
        table.add_row(f"  {s.diagnosis_names[key]}", f"{first:{fmt}} → {last:{fmt}}")
    if s.eval_loss_first is not None:
        what = "held-out loss, reference answers" if s.eval_reward_first is not None else "held-out loss"
        table.add_row(what, f"{s.eval_loss_first:.4f} → {s.eval_loss_last:.4f} nats/token")
    if s.eval_reward_first is not None:
        table.add_row("held-out greedy reward", f"{s.eval_reward_first:.3f} → {s.eval_reward_last:.3f}")
    total = s.compute_s + s.sync_s
    if total > 0:
        table.add_row("inner steps / syncing", f"{s.compute_s:.1f}s / {s.sync_s:.1f}s "
                                                 f"({100 * s.sync_s / total:.1f}% syncing, all replicas)")
    table.add_row("store bytes moved (sync)", f"{s.bytes_moved / 1e6:.1f} MB{s.synced_note}")
    if s.failed_at_start_config:
        table.add_row("failed at start (config)", ", ".join(map(str, s.failed_at_start_config)))
    if set(s.failed_at_start) - set(s.failed_at_start_config):
        table.add_row("failed at start", ", ".join(str(r) for r in s.failed_at_start
                                                   if r not in s.failed_at_start_config))
    if s.lost_replicas:
        table.add_row("lost replicas (died while training)", ", ".join(map(str, s.lost_replicas)))
    if s.cancelled_replicas:
        table.add_row("cancelled replicas", ", ".join(map(str, s.cancelled_replicas)))
    console.print(table)  # why each replica ended is under the status table just above (reason_lines)
    for note in s.notes:
        console.print(f"note: {note}", highlight=False)
    for warning in s.warnings:
        err_console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    console.print(f"run URI: {run.uri}", highlight=False)  # outside the table: never truncated


def print_checks(console: Console, checks: list[Any]) -> None:
    """One line per credential check (:mod:`composer_cloud.runs.doctor`): ok or FAIL, and what to do."""
    for c in checks:
        mark = "[green]ok[/]  " if c.ok else "[bold red]FAIL[/]"
        console.print(f"{mark} {escape(c.name)}: {escape(c.detail)}", highlight=False)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _state_cell(r: Any) -> str:
    """A replica's state as people read it: ``failed at start (config)`` and ``lost`` are different failures."""
    from composer_cloud.runs.summary import replica_outcome

    return replica_outcome(r)


def reason_lines(status: RunStatus) -> list[str]:
    """Why each replica that did not succeed ended (``r1 lost: ...``), then the run's problems and warnings:
    printed under the table, full width and whole (a table cell of an 80-column terminal cuts them)."""
    from composer_cloud.runs.summary import reason, replica_outcome

    lines = [f"r{r.rank} {replica_outcome(r)}: {reason(r)}" for r in status.replicas
             if r.message and r.state != "succeeded"]
    lines += [*status.problems, *status.warnings]
    if status.store_error:
        lines.append(f"store unreachable, showing the last known state: {status.store_error}")
    return lines


def _decoupled(status: RunStatus) -> bool:
    return status.sync_mode == "decoupled"


def replica_round(r: Any, status: RunStatus) -> int | None:
    """The round a lock-step replica is in (or ended in), counted from 1 as the logs count it.

    Its heartbeat holds the 0-based index of the round in progress (the round count once it is done)."""
    if r.last_round is None:
        return None
    return min(r.last_round + 1, status.rounds)


def progress_title(status: RunStatus) -> str:
    """``running — round 2/4 (1 committed), step 14/40`` (rounds counted from 1, as the logs count them);
    a finished run ``completed — 4/4 rounds committed``; decoupled runs count contributions and merges
    against the fleet's budget (``replicas × rounds`` contributions), never a round number."""
    n, done = status.rounds, status.rounds_committed
    if _decoupled(status):
        budget = status.rounds * len(status.replicas or [None]) if status.replicas else status.rounds
        made = sum(r.last_round or 0 for r in status.replicas)
        return f"{status.state} — contributions {min(made, budget)}/{budget}, {done} merge{'s' if done != 1 else ''}"
    if status.state == RunState.RUNNING:
        title = f"running — round {min(done + 1, n)}/{n} ({done} committed)"
        if status.step is not None:
            title += f", step {status.step}/{status.total_steps}"
        return title
    return f"{status.state} — {done}/{n} rounds committed"


def status_json(status: RunStatus) -> dict[str, Any]:
    """``status --json`` (and the status in ``launch``/``resume``/``wait --json``): the run's fields, with rounds
    named for what they count and numbered from 1 like everything people read (docs/metrics.md):
    ``rounds_committed`` (a count), ``latest_durable_round`` (the newest round whose global state is durable,
    1-based; null before the first), per replica ``round`` (lock-step: the round it is in or ended in, 1-based)
    or ``contributions`` (decoupled: how many it published)."""
    out = status.to_json()
    durable = out.pop("last_durable_round")
    out["latest_durable_round"] = None if durable is None else durable + 1
    for info, r in zip(status.replicas, out["replicas"]):
        last = r.pop("last_round")
        if _decoupled(status):
            r["contributions"] = last
        else:
            r["round"] = replica_round(info, status)
    return out


def status_table(status: RunStatus) -> Group:
    """The run's table (title: state and progress; a row per replica), and under it, full width, why replicas
    ended and what keeps the run from completing (:func:`reason_lines`)."""
    title = f"{status.run_id}: {progress_title(status)}"
    if status.elapsed_s is not None:
        title += f" — elapsed {_duration(status.elapsed_s)}"
    if status.eta_s is not None:
        title += f", ETA {_duration(status.eta_s)}"
    table = Table(title=title)
    reps = status.replicas
    # Columns that say nothing for this run (one executor, no rewards, no restarts, no messages) are left out.
    cols: list[tuple[str, Any]] = [("rank", lambda r: str(r.rank) if r.role == "replica" else f"{r.rank} (worker)")]
    if len({r.executor for r in reps}) > 1:
        cols.append(("executor", lambda r: r.executor))
    if _decoupled(status):
        where = ("contributions", lambda r: "-" if r.last_round is None else str(r.last_round))
    else:
        where = ("round", lambda r: "-" if r.last_round is None else f"{replica_round(r, status)}/{status.rounds}")
    cols += [("state", _state_cell), where,
             ("step", lambda r: "-" if r.step is None else str(r.step)), ("loss", lambda r: _fmt(r.loss, ".4f"))]
    if any(r.reward is not None for r in reps):
        cols.append(("reward", lambda r: _fmt(r.reward, ".3f")))
    cols.append(("steps/s", lambda r: _fmt(r.steps_per_s, ".2f")))
    if any(r.exit_code not in (None, 0) or r.state == "failed" for r in reps):
        cols.append(("exit", lambda r: exit_reason(r.exit_code, r.state)))
    if any(r.restarts or r.state == "failed" for r in reps):  # why it stopped: restarts used up, or none allowed
        cols.append(("restarts", lambda r: str(r.restarts)))
    for name, _ in cols:
        table.add_column(name, no_wrap=name == "state")
    for r in reps:
        table.add_row(*[get(r) for _, get in cols])
    fleet = [fleet_line(status)] if any(r.role != "replica" for r in reps) else []
    return Group(table, *[Text(line, no_wrap=False, overflow="fold") for line in [*fleet, *reason_lines(status)]])


def fleet_line(status: RunStatus) -> str:
    """``rollout workers: 2 (2 running), 14 batches published, 35.2 tokens/s; trainers used 12, ...``: the fleet
    summary :meth:`~composer_cloud.runs.status.RolloutFleet.line` (``report`` shows the same figures)."""
    fleet = RolloutFleet.from_status(status)
    return "" if fleet is None else fleet.line()


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def metrics_table(run_id: str, rows: list[dict[str, Any]], kind: str | None) -> Table:
    """``metrics``' table: the fields that matter (``--csv``/``--json`` carry every field); rounds from 1;
    each column as wide as its widest cell, so a number is never cut (``0.0001…``)."""
    from composer_cloud.storage.records.metrics import columns

    headers = {"round": "round", "rank": "rank", "step": "step", "launch": "launch", "committed": "ok",
               "loss": "loss", "train_loss": "loss", "reward_mean": "reward", "eval_loss": "eval loss",
               "eval_reward_mean": "eval reward", "compute_s": "compute s", "sync_s": "sync s",
               "time_s": "step s", "superseded": "superseded"}
    present = set(columns(rows))
    cols = [c for c in headers if c in present and (c != "launch" or len({r.get("launch") for r in rows}) > 1)]
    table = Table(title=f"{run_id}: {len(rows)} {kind or 'round'} rows"
                  + (" (--kind step: per-step rows; --csv/--json: every field)" if not kind else ""))
    cells = [[_cell(r.get(c) if c != "round" else r["round"] + 1) for c in cols] for r in rows]
    for i, c in enumerate(cols):
        table.add_column(headers[c], justify="right", no_wrap=True,
                         min_width=max([len(headers[c]), *(len(row[i]) for row in cells)]))
    for row in cells:
        table.add_row(*row)
    return table


def runs_table(store_uri: str, found: list[Any]) -> Table:
    """``ls``: id, state, progress (lock-step: rounds committed of the run's; decoupled: merges), age."""
    table = Table(title=f"runs under {store_uri}")
    for col in ("run id", "state", "rounds", "age"):
        table.add_column(col)
    for r in found:
        progress = (f"{r.rounds_committed} merges" if r.sync_mode == "decoupled"  # no round budget to count against
                    else f"{r.rounds_committed}/{r.rounds}")
        table.add_row(r.run_id, r.state, progress, age(r.launched_at))
    return table


def tracking_line(result: Any, logdir: Any, project: str) -> str:
    """What ``report_to`` wrote and how to look at it, one line."""
    where = [f"TensorBoard: tensorboard --logdir {logdir}"] if result.tensorboard_dir else []
    where += [f"trackio: trackio show --project {project}"] if result.trackio_project else []
    where += [f"wandb: {len(result.wandb_runs)} runs in project {project}"] if result.wandb_runs else []
    where += [f"MLflow: {len(result.mlflow_runs)} runs in experiment {project}"] if result.mlflow_runs else []
    return (f"tracking ({', '.join(result.report_to)}): {result.step_points} step points of replicas "
            f"{result.replicas}, {result.rounds} rounds; " + "; ".join(where))


def interrupted(exc: KeyboardInterrupt) -> tuple[str, dict[str, Any]]:
    """Ctrl-C before ``launch`` returned: the line to print and its ``--json`` form."""
    from composer_cloud.runs import LaunchInterrupted

    if isinstance(exc, LaunchInterrupted):
        return exc.advice(), {"run_uri": exc.run_uri, "interrupted": True, "written": exc.written,
                              "started": exc.started}
    return ("interrupted before anything was written: nothing was launched",
            {"interrupted": True, "written": False, "started": False})


def dry_run_report(console: Console, checked: Any, checks: list[Any], *, as_json: bool) -> list[Any]:
    """``launch --dry-run``: the plan and the credential checks (or their JSON); returns the failed checks."""
    import dataclasses
    import json
    import sys

    failed = [c for c in checks if not c.ok]
    if as_json:
        sys.stdout.write(json.dumps({"run_uri": checked.run_uri, "dry_run": True, "ok": not failed,
                                     "spec": checked.spec.to_json_dict(),
                                     "plans": [dataclasses.asdict(p) for p in checked.plans],
                                     "training": dict(checked.training),
                                     "credentials": [dataclasses.asdict(c) for c in checks]}, indent=2,
                                    default=str) + "\n")
    else:
        print_plan(console, checked.spec, checked.plans, checked.training)
        print_checks(console, checks)
    return failed


def print_samples(run: Run, *, ranks: list[int] | None, tail: int | None, as_json: bool) -> int:
    """``logs --samples``: each replica's sample completions per round (``--tail N``: the last N rounds), every
    text made printable; one JSON object per line with ``--json``. Returns the exit code (1: none written)."""
    import json
    import sys

    from composer_cloud.runs.samples import one_line, read_samples

    rows = [s for s in read_samples(run.store, last_rounds=tail) if ranks is None or s.rank in ranks]
    for s in rows:
        if as_json:
            sys.stdout.write(json.dumps(s.to_json()) + "\n")
            continue
        reward = "-" if s.reward is None else f"{s.reward:.3f}"
        sys.stdout.write(f"[r{s.rank}] round {s.round} step {s.step} reward {reward}\n"
                         f"  prompt:     {one_line(s.prompt)}\n  completion: {one_line(s.completion)}\n")
    if not rows:
        sys.stderr.write(f"no sample completions in {run.uri} (trainer.log_samples = 0, a trainer that writes "
                         "none, or no round has ended yet)\n")
    return 0 if rows else 1

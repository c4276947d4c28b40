"""Issue 34, finding 3: one round numbering everywhere a person reads one, counted from 1.

The store counts rounds from 0; the heal, behind, voided, void and resume log lines printed those indices
between step lines that count from 1. Every log and error format of the package that names a round (or a
checkpoint by its round) now passes the number through ``round_numbers.shown_round``, which the first test
holds the whole package to; the others check what the messages say.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import torch

import composer_cloud
from composer_cloud.round_numbers import round_index, shown_round
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce
from composer_cloud.sync.lockstep.manager import ObjectStoreManager
from composer_cloud.sync.lockstep.results import BehindError, RoundTimeout
from workers import allreduce_config

ROOT = Path(composer_cloud.__file__).parent
#: A number after this word is a round (or the round of a checkpoint); ``--round``/``rounds`` are not.
_ROUND_WORD = re.compile(r"(?<![-\w])(round|checkpoint) $")
_PLACEHOLDER = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa%]")
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}
#: (file, expression) pairs after "round " that are not a store index: counts, 1-based values, store keys.
_NOT_AN_INDEX = {
    ("cli_views.py", "min(done + 1, n)"),  # the round in progress: committed count + 1
    ("cli_views.py", "s.round"),  # runs/samples.SampleRow.round is counted from 1 already
    ("runs/status.py", "spec.rounds"),  # the last round of a completed run: its count
}


def _converted(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Call) and getattr(expr.func, "id", getattr(expr.func, "attr", None)) == "shown_round"


def _unconverted(allowed: set[tuple[str, str]] | None = None) -> list[str]:
    """Every log/error/message format in composer_cloud/ that puts a round number after "round " (or
    "checkpoint ") without ``shown_round``: f-strings anywhere, and ``%`` formats of logger calls. The
    :data:`_NOT_AN_INDEX` entries met on the way are added to ``allowed``."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            pairs: list[tuple[str, ast.expr]] = []
            if isinstance(node, ast.JoinedStr):
                before = ""
                for value in node.values:
                    if isinstance(value, ast.Constant):
                        before = str(value.value)
                        continue
                    pairs.append((before, value.value))
                    before = ""
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOG_CALLS
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                fmt, i = node.args[0].value, 0
                for m in _PLACEHOLDER.finditer(fmt):
                    if m.group() == "%%":
                        continue
                    i += 1
                    if i < len(node.args):
                        pairs.append((fmt[:m.start()], node.args[i]))
            for before, expr in pairs:
                source = ast.unparse(expr)
                if not _ROUND_WORD.search(before) or _converted(expr) or source.startswith(("layout.", "store.uri")):
                    continue
                if (rel, source) in _NOT_AN_INDEX:
                    if allowed is not None:
                        allowed.add((rel, source))
                    continue
                found.append(f"{rel}:{node.lineno}: ...{before[-30:]}{{{source}}}")
    return found


def test_every_message_that_names_a_round_counts_it_from_1():
    """Before: manager.py (heal, behind, voided), rounds.py (void), replica/lockstep.py (resume), the checkpoint
    messages and the sync errors printed the store's 0-based index."""
    allowed: set[tuple[str, str]] = set()
    found = _unconverted(allowed)
    assert not found, "\n".join(["use composer_cloud.round_numbers.shown_round:", *found])
    assert allowed == _NOT_AN_INDEX, f"stale exceptions: {_NOT_AN_INDEX - allowed}"


def test_the_scan_finds_what_it_looks_for():
    tree = ast.parse('logger.info("replica %d healed to round %d", rank, r)\nx = f"round {r} done"')
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert not _converted(calls[0].args[2]) and _ROUND_WORD.search("replica %d healed to round ")
    assert _converted(ast.parse("shown_round(r)").body[0].value) and not _ROUND_WORD.search("--round ")


def test_shown_round_counts_from_1_and_round_index_is_its_inverse():
    assert [shown_round(i) for i in (0, 1, 9)] == [1, 2, 10] and shown_round(-1) == -1
    assert all(round_index(shown_round(i)) == i for i in range(5))
    with pytest.raises(ValueError, match="--round 0: rounds are counted from 1"):
        round_index(0)


def test_the_sync_errors_name_rounds_from_1():
    assert str(BehindError(3)).startswith("round 4 is already committed")
    assert str(RoundTimeout(0, [2], "no quorum")).startswith("round 1: no quorum; missing replicas: [2]")


def test_a_void_is_logged_with_the_round_counted_from_1(tmp_path, caplog):
    store = Store(f"file://{tmp_path}/s")
    with caplog.at_level(logging.WARNING, logger="composer_cloud.sync.lockstep.rounds"):
        assert rounds.declare_void(store, 3, 0, by=1, reason="its state was never durable")
    assert "round 4 attempt 0 declared void by replica 1" in caplog.text, caplog.text


class _Params:
    def __init__(self) -> None:
        self.w = torch.zeros(8)

    def register(self, manager: ObjectStoreManager) -> None:
        manager.register_state_dict_fn("w", lambda t: self.w.copy_(t["w"]), lambda: {"w": self.w})


def _manager(store: Store, start: int) -> ObjectStoreManager:
    ar = ObjectStoreAllReduce(store, 0, allreduce_config(1, quorum_timeout_s=5, round_timeout_s=5))
    m = ObjectStoreManager(ar, GlobalStateStore(store), heal_timeout_s=5, takeover_after_s=0, void_after_s=2,
                           start_step=start)
    _Params().register(m)
    return m


def _sync(m: ObjectStoreManager) -> bool:
    m.start_quorum()
    m.allreduce(torch.ones(8)).wait()
    return m.should_commit()


def test_a_replica_behind_the_run_logs_rounds_as_its_step_lines_do(tmp_path, caplog):
    """Two rounds (store indices 0 and 1) commit; a replica restarted at index 0 is behind and heals. Its lines
    said `at round 0, committed 1` and `healed to committed round 1`; the step lines of that run say 1/2, 2/2."""
    uri = f"file://{tmp_path}/s"
    first = _manager(Store(uri), 0)
    assert _sync(first) and _sync(first)
    first.close()
    late = _manager(Store(uri), 0)
    with caplog.at_level(logging.INFO, logger="composer_cloud.sync.lockstep.manager"):
        late.start_quorum()
    late.allreduce(torch.ones(8)).wait()
    assert not late.should_commit() and late.current_step() == 2
    late.close()
    assert "is behind (at round 1; round 2 has committed)" in caplog.text, caplog.text
    assert "healed to committed round 2" in caplog.text, caplog.text

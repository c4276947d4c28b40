"""The sandbox that scores completions: limits, isolation, and that it never raises."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from composer_cloud.trainer.three_channel.sandbox import Sandbox, SandboxLimits, network_isolation, run_tests
from composer_cloud.trainer.three_channel.tasks import PythonFunctionsTask, extract_program

FAST = SandboxLimits(timeout_s=3.0, per_test_timeout_s=0.5)
ADD = "def f(x):\n    return x + 1\n"


def test_fraction_of_tests_passed():
    r = run_tests(ADD, ["assert f(1) == 2", "assert f(2) == 3", "assert f(0) == 5", "assert f('a')"], FAST)
    assert (r.passed, r.total, r.status) == (2, 4, "ok")
    assert r.score == 0.5


def test_infinite_loop_times_out_and_scores_zero():
    start = time.perf_counter()
    r = run_tests("while True:\n    pass\n", ["assert True"], FAST)
    assert r.status == "timeout" and r.score == 0.0
    assert time.perf_counter() - start < FAST.timeout_s + 2


def test_hanging_test_costs_only_itself():
    program = "def f(x):\n    while x:\n        pass\n    return 0\n"
    r = run_tests(program, ["assert f(0) == 0", "f(1)", "assert f(0) == 0"], FAST)
    assert r.passed == 2 and r.total == 3 and r.status == "ok"


def test_wall_clock_kill_when_the_alarm_is_disabled():
    # The program disarms the per-test alarm; the parent's wall-clock kill still ends it.
    program = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n"
    start = time.perf_counter()
    r = run_tests(program, ["assert True"], SandboxLimits(timeout_s=1.5, per_test_timeout_s=0.5))
    elapsed = time.perf_counter() - start
    assert r.status == "timeout" and r.score == 0.0
    assert 1.4 < elapsed < 5.0


class _Listener:
    """A TCP server on loopback that records whether anyone connected."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connected = False
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
                self.connected = True
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self._t.join()
        self.sock.close()


@pytest.mark.parametrize(
    "how",
    [
        "import socket\n    s = socket.create_connection(('127.0.0.1', PORT), timeout=1)",
        "import urllib.request\n    urllib.request.urlopen('http://127.0.0.1:PORT/', timeout=1)",
        "import importlib\n    m = importlib.import_module('_socket')\n    s = m.socket()\n    s.connect(('127.0.0.1', PORT))",
    ],
)
@pytest.mark.parametrize("layers", ["all", "audit-hook-only"])
def test_network_calls_fail(how, layers, monkeypatch):
    if layers == "audit-hook-only":  # as on a host without network namespaces
        import composer_cloud.trainer.three_channel.sandbox as sb

        monkeypatch.setattr(sb, "network_isolation", lambda: None)
    server = _Listener()
    try:
        # Sanity: the server is reachable from this (unsandboxed) process.
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
        time.sleep(0.3)
        assert server.connected
        server.connected = False
        program = "def f():\n    " + how.replace("PORT", str(server.port)) + "\n    return 1\n"
        r = run_tests(program, ["assert f() == 1"], FAST)
        time.sleep(0.3)
        assert r.passed == 0 and r.score == 0.0
        assert not server.connected
    finally:
        server.close()


@pytest.mark.skipif(network_isolation() is None, reason="no network namespace on this host")
def test_network_namespace_blocks_even_without_the_audit_hook():
    # Run a child exactly as the sandbox does, minus the harness: the kernel layer alone.
    import subprocess
    import sys

    prefix = network_isolation()
    code = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as e:\n    print(type(e).__name__)"
    out = subprocess.run([*prefix, sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=10)
    assert "Error" in out.stdout or "Refused" in out.stdout


@pytest.mark.parametrize(
    "program",
    [
        "import os\nos.abort()\n",  # the child dies on a signal
        "def f(:\n",  # syntax error
        "raise SystemExit(3)\n",
        "x = bytearray(2**31)\n",  # over the address-space limit
        "import sys\nsys.setrecursionlimit(10**6)\ndef r(n):\n    return r(n + 1)\nr(0)\n",  # C-stack overflow -> crash
    ],
)
def test_a_crash_scores_zero_and_does_not_raise(program):
    r = run_tests(program, ["assert True", "assert 1 == 1"], FAST)
    assert r.score == 0.0 and r.passed == 0
    assert r.status in ("crash", "timeout")


def test_forged_output_does_not_count():
    program = "print('pass 0')\nprint('x pass 0')\nimport os\nos.write(1, b'deadbeef pass 0\\n')\n"
    r = run_tests(program, ["assert False"], FAST)
    assert r.passed == 0


def test_cannot_kill_the_parent_or_spawn_processes():
    for program in [
        "import os\nos.kill(os.getppid(), 9)\n",
        "import subprocess\nsubprocess.run(['true'])\n",
        "import os\nos.system('true')\n",
        "import ctypes\n",
    ]:
        r = run_tests(program, ["assert True"], FAST)
        assert r.score == 0.0, program
    assert os.getpid() > 0  # we are still alive


def test_writes_only_inside_its_temporary_directory(tmp_path):
    target = tmp_path / "outside.txt"
    r = run_tests(f"open({str(target)!r}, 'w').write('x')\n", ["assert True"], FAST)
    assert r.score == 0.0 and not target.exists()
    r = run_tests("open('inside.txt', 'w').write('x')\n", ["assert open('inside.txt').read() == 'x'"], FAST)
    assert r.score == 1.0


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    r = run_tests("import os\n", ["assert 'AWS_SECRET_ACCESS_KEY' not in os.environ"], FAST)
    assert r.score == 1.0


def test_internal_errors_score_zero_instead_of_raising(monkeypatch):
    import composer_cloud.trainer.three_channel.sandbox as sb

    def boom(*a, **k):
        raise OSError("no such executable")

    monkeypatch.setattr(sb.subprocess, "Popen", boom)
    r = run_tests(ADD, ["assert f(1) == 2"], FAST)
    assert r.status == "error" and r.score == 0.0 and "no such executable" in r.detail


def test_run_many_keeps_order_and_isolates_failures():
    box = Sandbox(FAST, max_workers=2)
    try:
        programs = [ADD, "while True:\n    pass\n", "import os\nos.abort()\n", "def f(x):\n    return x\n"]
        results = box.run_many(programs, [["assert f(1) == 2"]] * 4)
        assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0]
        assert results[1].status == "timeout" and results[2].status == "crash"
    finally:
        box.close()


def test_demo_task_reward_is_the_fraction_of_tests_passed():
    task = PythonFunctionsTask(n_train=48, n_eval=8, seed=3, limits=FAST)
    rows = task.examples("train")
    branch = next(r for r in rows if "if a > b" in r["prompt"])
    first_line = branch["reference"].split("\n")[0] + "\n    return None\n"  # right only when a > b
    scores = task.reward([branch["reference"], first_line, "while True: pass", " ((("], [branch] * 4)
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(0.5)
    assert scores[2] == 0.0 and scores[3] == 0.0
    # every reference solution passes all of its tests; held-out names are disjoint from training names
    assert task.reward([r["reference"] for r in rows], rows) == [1.0] * len(rows)
    eval_names = {r["entry_point"] for r in task.examples("eval")}
    assert eval_names and not eval_names & {r["entry_point"] for r in rows}


def test_extract_program_cuts_at_the_end_of_the_function():
    prompt = "def f(x):\n    return"
    assert extract_program(prompt, " x + 1\ndef g(:\nassert False\n") == "def f(x):\n    return x + 1\n"
    assert extract_program(prompt, " x + 1\n\n    # still inside\n") == "def f(x):\n    return x + 1\n\n    # still inside\n"

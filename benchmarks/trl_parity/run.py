"""TRL's own GRPO tests against stock ``GRPOTrainer`` and against ``ThreeChannelGRPOTrainer`` (channel 1 only).

    git clone https://github.com/huggingface/trl /tmp/trl          # any checkout; nothing of it is copied here
    python benchmarks/trl_parity/run.py --trl /tmp/trl [--workers 2] [--json benchmarks/out/trl_parity.json]

Runs ``tests/test_grpo_trainer.py`` of that checkout twice, offline, against the installed ``trl``: once as it
is, once with ``trl.GRPOTrainer`` replaced by the subclass with ``sdpo_weight = dpo_weight = 0``
(``conftest.py``). Models come from a hub cache of tiny random models built here (``build_hub.py``), the ``zen``
dataset from a few local rows. Prints pass/fail/skip counts per trainer and every test that passes on stock TRL
but not on the subclass with its error, and writes them as JSON. A test newer than the installed ``trl`` may
fail on both; only the difference says something about the subclass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ZEN = ["Beautiful is better than", "Explicit is better than", "Simple is better than", "Complex is better than",
       "Flat is better than", "Sparse is better than", "Now is better than", "Namespaces are one"]


def prepare(trl_checkout: Path, work: Path) -> None:
    """TRL's test file and its helpers in ``work/tests``, our plugin beside them, the data and the hub cache."""
    tests = work / "tests"
    tests.mkdir(parents=True)
    for name in ("test_grpo_trainer.py", "testing_utils.py"):
        shutil.copy(trl_checkout / "tests" / name, tests / name)
    (tests / "__init__.py").write_text("")
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    # Helpers the checkout's testing_utils imports from a newer trl than the installed one become "unavailable".
    utils = (tests / "testing_utils.py").read_text()
    block = re.search(r"from trl\.import_utils import \((.*?)\)", utils, re.S)
    if block:
        names = [n.strip().rstrip(",") for n in block.group(1).split("\n") if n.strip()]
        shim = "import trl.import_utils as _iu\n" + "".join(f"{n} = getattr(_iu, {n!r}, lambda: False)\n" for n in names)
        (tests / "testing_utils.py").write_text(utils.replace(block.group(0), shim))
    data = work / "data"
    data.mkdir()
    for split, rows in (("train", ZEN[:6]), ("test", ZEN[6:])):
        (data / f"standard_prompt_only_{split}.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
        (data / f"conversational_prompt_only_{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": [{"role": "user", "content": r}]}) + "\n" for r in rows))
    subprocess.run([sys.executable, str(HERE / "build_hub.py"), str(work / "hub")], check=True, capture_output=True)


def run(work: Path, mode: str, workers: int) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of the error)}`` for one trainer."""
    report = work / f"{mode}.xml"
    env = dict(os.environ, HF_HUB_CACHE=str(work / "hub"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "datasets"), TRL_PARITY_DATA=str(work / "data"),
               TRL_UNDER_TEST=mode, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests"]
    if workers > 1:
        args[4:4] = ["-n", str(workers)]
    subprocess.run(args, cwd=work, env=env, capture_output=True)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "").splitlines()[0][:200]
            elif child.tag == "skipped":
                outcome = "skipped"
        results[test] = (outcome, message)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl", type=Path, required=True, help="a checkout of huggingface/trl")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "trl_parity.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trl-parity-") as tmp:
        work = Path(tmp)
        prepare(args.trl.resolve(), work)
        results = {mode: run(work, mode, args.workers) for mode in ("stock", "subclass")}
    counts = {mode: {o: sum(v[0] == o for v in r.values()) for o in ("passed", "failed", "skipped")}
              for mode, r in results.items()}
    stock, ours = results["stock"], results["subclass"]
    lost = {t: ours.get(t, ("missing", ""))[1] for t, (o, _) in stock.items() if o == "passed"
            and ours.get(t, ("missing", ""))[0] != "passed"}
    print(f"{'trainer':<10} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for mode, c in counts.items():
        print(f"{mode:<10} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
    print(f"\n{len(lost)} tests pass on stock GRPOTrainer but not on the subclass:")
    for test, message in sorted(lost.items()):
        print(f"  {test}: {message}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"counts": counts, "stock_only": lost, "tests": results}, indent=2))


if __name__ == "__main__":
    main()

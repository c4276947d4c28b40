#!/usr/bin/env bash
# One command for a GPU machine with no network (docs/gpu.md, "The GPU check"): installs the carried wheels,
# runs the product end to end on the GPU (the demo model, then a Qwen2.5-0.5B-shaped model with LoRA), the
# rollout micro-benchmark (hf against the fast mode) and benchmarks/gpu.py, sized for <= 8 minutes on one H100.
#
#   bash benchmarks/gpu_check.sh          # on the GPU machine (after bash benchmarks/gpu_wheels.sh here)
#   bash benchmarks/gpu_check.sh --cpu    # every stage rehearsed on a CPU with tiny shapes (a test runs it)
#
# Every stage runs under its own `timeout`; the report, $OUT/gpu_check.json (or benchmarks/out/gpu_check.json
# when OUT is unset), is rewritten after every stage, so a stage that fails or times out leaves the rows of
# the others (see benchmarks/gpu_check_steps.py for the row format). Beside it: each stage's full log
# (gpu_check_logs/), gpu.py's own JSON (gpu.json) and rollout_speed.py's (rollout_speed.json).
# Exit code: 0 when no stage failed or timed out, 1 otherwise.
#
# Environment:
#   OUT                          where the report goes (the device tool's $OUT)
#   GPU_CHECK_STAGES             comma-separated stages to run (default: all); the others get a "skipped" row
#   GPU_CHECK_TIMEOUT_<STAGE>    a stage's timeout in seconds, e.g. GPU_CHECK_TIMEOUT_E2E_DEMO=1
#   PYTHON                       the interpreter (default: python, else python3)
# Stages (GPU timeout / --cpu timeout, seconds; the GPU ones add up to 480):
#   install         40 / 60   pip install --no-index --find-links .gpu-wheels (--cpu: lists them), then import
#                             composer_cloud.replica, torchft, trl, datasets and record the versions
#   e2e-demo        70 / 150  composer-cloud launch --executor local --replicas 2 --rounds 3, demo model, bf16,
#                             on cuda; round times from its metrics; export; load the export with transformers
#   e2e-qwen-lora  125 / 150  the same with a Qwen2.5-0.5B-shaped model (random weights) saved to a folder,
#                             LoRA r 16 on all linear layers (--cpu: gpu.py's tiny shape)
#   fast-rollout    75 / 90   benchmarks/rollout_speed.py: tokens/s and MFU of hf and hf-fast, their ratio
#                             (skipped, "rollout_speed.py not available", where the file is missing)
#   gpu-bench      170 / 120  benchmarks/gpu.py: full and LoRA x hf, hf-fast (and vllm where it imports) x
#                             composer-cloud vs plain TRL; peak memory; the sync share at H = 50, time-boxed
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
for a in "$@"; do
  case "$a" in
    --cpu) MODE=cpu ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (use --cpu)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$(command -v python || command -v python3)}
OUT_DIR=${OUT:-$ROOT/benchmarks/out}
mkdir -p "$OUT_DIR/gpu_check_logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPORT=$OUT_DIR/gpu_check.json
LOGS=$OUT_DIR/gpu_check_logs
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
STEPS=$ROOT/benchmarks/gpu_check_steps.py
# composer_cloud from this working tree, installed or not (the GPU machine does not install the project). Where this
# tree is what the interpreter imports already (an editable install), the environment stays as it is: PYTHONPATH is
# in the local fork server's key, so an unchanged one lets the stages' launches share the user's warm server.
# (Asked from / : from here, Python would find ./composer_cloud whatever is installed.)
if [[ $(cd / && "$PY" -c 'import composer_cloud, os; print(os.path.dirname(os.path.dirname(composer_cloud.__file__)))' \
        2>/dev/null) != "$ROOT" ]]; then
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export MODE ROOT PY WORK LOGS OUT_DIR STEPS
export COLUMNS=${COLUMNS:-200}  # rich's tables (status, summaries) unwrapped in the logs and error tails
if [[ $MODE == cpu ]]; then DEV=cpu; else DEV=cuda; fi
export DEV
STAGES=(install e2e-demo e2e-qwen-lora fast-rollout gpu-bench)
declare -A TIMEOUT_GPU=([install]=40 [e2e-demo]=70 [e2e-qwen-lora]=125 [fast-rollout]=75 [gpu-bench]=170)
# --cpu: ceilings for a shared 2-core machine, where starting Python processes (torch, transformers) dominates
declare -A TIMEOUT_CPU=([install]=60 [e2e-demo]=150 [e2e-qwen-lora]=150 [fast-rollout]=90 [gpu-bench]=120)

cc() {  # the composer-cloud CLI of this working tree
  "$PY" -c "import sys; sys.argv[0] = 'composer-cloud'; from composer_cloud.cli import main; main()" "$@"
}
skip() {  # skip "reason": end a stage as skipped (exit code 3, gpu_check_steps.SKIP_RC)
  "$PY" -c 'import json, sys; open(sys.argv[1], "w").write(json.dumps({"reason": sys.argv[2]}))' "$NUM" "$1"
  exit 3
}
export -f cc skip

stage_install() {
  local req=.gpu-wheels/requirements.txt
  if [[ $MODE == cpu ]]; then
    if [[ -f $req ]]; then
      # A dry check: every requirement has its wheel (they are cp312 builds: this Python may not install them).
      "$PY" "$STEPS" versions --out "$NUM" --wheels .gpu-wheels \
        --reason "--cpu: nothing installed; the carried wheels listed, imports checked" || exit 1
    else
      "$PY" "$STEPS" versions --out "$NUM" --reason "--cpu and no .gpu-wheels: nothing to install; imports checked" || exit 1
    fi
    exit 3
  fi
  if [[ ! -f $req ]]; then
    "$PY" "$STEPS" versions --out "$NUM" \
      --reason "no .gpu-wheels (run bash benchmarks/gpu_wheels.sh where there is network and carry it): the stack imports as it is" \
      || exit 1
    exit 3
  fi
  # --isolated: no configured index or find-links; pip adds only what is missing, the image's stack stays.
  local pip=("$PY" -m pip install --isolated --no-index --find-links .gpu-wheels -r "$req")
  "${pip[@]}" > "$WORK/pip.log" 2>&1
  local rc=$?
  cat "$WORK/pip.log"
  if (( rc != 0 )); then
    # A distribution's Python may be "externally managed" (PEP 668): this machine is lent, install anyway.
    grep -q externally-managed "$WORK/pip.log" && "${pip[@]}" --break-system-packages || exit 1
  fi
  "$PY" "$STEPS" versions --out "$NUM" --wheels .gpu-wheels
}

launch_e2e() {  # launch_e2e NAME ARGS...: a 2-replica, 3-round run, its round times, its export loaded
  local name=$1; shift
  local store=file://$WORK/runs run_id=gpu-check-$name-$(date +%s)
  local uri=$store/$run_id
  echo "$uri" > "$WORK/$name.uri"
  cc launch --executor local --replicas 2 --rounds 3 --store "$store" --run-id "$run_id" --no-detach \
    --set device="$DEV" --set model.precision=bf16 "$@" || { echo "launch failed:"; cc status "$uri"; exit 1; }
  # composer-cloud export (run in-process by the step), then the round times and the export loaded
  "$PY" "$STEPS" e2e --run "$uri" --export "$WORK/$name.export" \
    --device "$DEV" --expect-rounds 3 --base "$WORK/$name.model.json" --out "$NUM"
}

stage_e2e_demo() {
  if [[ $MODE == cpu ]]; then
    launch_e2e e2e-demo --inner-steps 1 --set trainer.batch_size=2 --set trainer.num_generations=2 \
      --set trainer.seq_len=8 --set trainer.eval_examples=1 --set trainer.sandbox_workers=1
  else
    launch_e2e e2e-demo --inner-steps 3 --set trainer.eval_examples=2
  fi
}

stage_e2e_qwen_lora() {
  local shape=qwen2.5-0.5b
  [[ $MODE == cpu ]] && shape=tiny
  "$PY" "$STEPS" save-model --shape "$shape" --out "$WORK/model-$shape" --numbers "$WORK/e2e-qwen-lora.model.json" || exit 1
  local lora=(--model "$WORK/model-$shape" --set model.lora.r=16 --set model.lora.alpha=32
              --set model.lora.target_modules=all-linear)
  if [[ $MODE == cpu ]]; then
    launch_e2e e2e-qwen-lora "${lora[@]}" --inner-steps 1 --set trainer.batch_size=2 --set trainer.num_generations=2 \
      --set trainer.seq_len=8 --set trainer.eval_examples=1 --set trainer.sandbox_workers=1
  else
    launch_e2e e2e-qwen-lora "${lora[@]}" --inner-steps 3 --set trainer.eval_examples=2
  fi
}

stage_fast_rollout() {
  [[ -f benchmarks/rollout_speed.py ]] || skip "rollout_speed.py not available"
  local shape=qwen2.5-0.5b n=32 t=256
  [[ $MODE == cpu ]] && { shape=tiny n=4 t=8; }
  # rollout_speed.py and the row's numbers in one process (torch and transformers imported once)
  "$PY" "$STEPS" rollout --completions "$n" --tokens "$t" --result "$OUT_DIR/rollout_speed.json" --shape "$shape" \
    --device "$DEV" --out "$NUM"
}

stage_gpu_bench() {
  # gpu.py rewrites its JSON after every row; post_gpu_bench reads it whatever happened here.
  if [[ $MODE == cpu ]]; then
    "$PY" benchmarks/gpu.py --device cpu --shapes tiny --batch 2 --generations 2 --completion 4 --steps 1 \
      --warmup 0 --sync-rounds 1 --sync-budget-s 10 --json "$OUT_DIR/gpu.json"
  else
    # 32 completions x 256 tokens as in issue 32's first GPU run; one timed step after one warm-up step per row
    "$PY" benchmarks/gpu.py --device cuda --shapes qwen2.5-0.5b --steps 1 --warmup 1 --sync-rounds 1 \
      --sync-budget-s 20 --json "$OUT_DIR/gpu.json"
  fi
}
export -f stage_install launch_e2e stage_e2e_demo stage_e2e_qwen_lora stage_fast_rollout stage_gpu_bench

post_stage() {  # post_stage NAME RC: after a stage, outside its timeout (its own, short)
  local name=$1 rc=$2
  case "$name" in
    e2e-*)  # a replica runs in its own session: a killed launcher leaves it running, so cancel the run
      if [[ $rc != 0 && -f $WORK/$name.uri ]]; then
        { echo "--- after the stage (rc $rc): cancel and status"
          timeout -k 5 20 bash -c 'cc cancel "$1"; cc status "$1"' _ "$(cat "$WORK/$name.uri")"; } >> "$LOGS/$name.log" 2>&1
      fi ;;
    gpu-bench)  # the rows gpu.py wrote before it ended, however it ended
      timeout -k 5 20 "$PY" "$STEPS" bench --result "$OUT_DIR/gpu.json" --out "$WORK/$name.json" \
        >> "$LOGS/$name.log" 2>&1 ;;
  esac
}

selected() {
  [[ -z ${GPU_CHECK_STAGES:-} ]] && return 0
  [[ ",${GPU_CHECK_STAGES// /}," == *",$1,"* ]]
}

main() {  # a function, read whole before it runs: editing this file during a run does not break the run
  "$PY" "$STEPS" init --json "$REPORT" --mode "$MODE" --stages "$(IFS=,; echo "${STAGES[*]}")" || exit 1
  echo "[gpu-check] $MODE mode; report: $REPORT; work: $WORK"
  rm -f "$OUT_DIR/gpu.json" "$OUT_DIR/rollout_speed.json"
  for name in "${STAGES[@]}"; do
    var=GPU_CHECK_TIMEOUT_$(echo "$name" | tr 'a-z-' 'A-Z_')
    if [[ $MODE == cpu ]]; then t=${!var:-${TIMEOUT_CPU[$name]}}; else t=${!var:-${TIMEOUT_GPU[$name]}}; fi
    export NUM=$WORK/$name.json
    log=$LOGS/$name.log
    t0=$(date +%s.%N)
    if selected "$name"; then
      echo "[gpu-check] $name (timeout ${t}s) ..."
      timeout -k 5 "$t" bash -c "stage_${name//-/_}" > "$log" 2>&1
      rc=$?
      post_stage "$name" "$rc"
    else
      echo '{"reason": "not selected (GPU_CHECK_STAGES)"}' > "$NUM"
      : > "$log"
      rc=3
    fi
    "$PY" "$STEPS" row --json "$REPORT" --stage "$name" --rc "$rc" --started "$t0" --timeout "$t" \
      --log "$log" --numbers "$NUM"
  done
  "$PY" "$STEPS" finish --json "$REPORT"
  status=$?
  rm -rf "$WORK"
  return $status
}
main; exit $?  # one line: bash has read it whole before main runs

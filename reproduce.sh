#!/usr/bin/env bash
# mpt: set up .venv (first run only), then
#   ./reproduce.sh [options]       the quick reproduction on built-in data: every model, FP32 vs reduced
#                                  precision, seeded tables with the paper's numbers beside them
#   ./reproduce.sh test [args]     the whole CPU test suite (args go to pytest)
# Finished runs are kept and not retrained; delete outputs/reproduce/ to start over.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.mpt-installed
ALL_MODELS=(resnet50 ssd biglstm dcgan deepspeech)

usage() {
  cat <<EOF
usage: ./reproduce.sh [--models m1,m2,...] [--seeds N] [--seeded m1,...] [--jobs J] [--out DIR]
       ./reproduce.sh test [pytest args...]

The quick reproduction of "Mixed Precision Training" on built-in data (see README "Measured results"):
each model in FP32 and in reduced precision (the paper's MP on a GPU; FP16 storage emulated,
precision=pseudo_fp16, on a CPU), gradient statistics, figures, and report.md with the paper's
numbers beside ours. Every preset pins threads=1, so a rerun gives the same numbers bit for bit.

  --models LIST   comma-separated subset of: ${ALL_MODELS[*]} (default: all)
  --seeds N       seeds of the seeded models' FP32 and reduced-precision rows (default 3)
  --seeded LIST   the models trained with --seeds seeds (default: resnet50,dcgan); the others
                  with seed 0 only. The SSD seed study: --models ssd --seeded ssd --seeds 5
  --jobs J        runs trained at the same time, one CPU thread each (default: the core count, at most
                  8; 1 on a GPU, so that runs do not share it while their speed is measured)
  --out DIR       output root (default outputs/reproduce)
  -h, --help      this text
EOF
}

setup() {
  # Reinstall when pyproject.toml changed since the last install (dependency pins live there).
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [[ -x $VENV/bin/python && -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    return
  fi
  echo "== setting up $VENV (torch 2.14.1, torchvision 0.29.1, hydra, tensorboard; a few minutes the first time)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip 2>/dev/null || true
  # pip byte-compiles everything: --no-compile saves ~20 s here but, where PYTHONDONTWRITEBYTECODE is
  # set, leaves every run recompiling torch's modules at start (~9 s a run, measured)
  "$VENV/bin/python" -m pip install --quiet -e '.[test]'
  echo "$want" > "$STAMP"
}

run_tests() {
  "$VENV/bin/python" -m pytest "$@"  # no paths given: pyproject testpaths (tests/)
}

# --- the quick reproduction ----------------------------------------------------------------------
MODELS=("${ALL_MODELS[@]}")
SEEDED=(resnet50 dcgan)
SEEDS=3
JOBS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
JOBS_GIVEN=0
OUT=outputs/reproduce

parse_options() {
  while (($#)); do
    if [[ $1 == --* && $1 != --help && $# -lt 2 ]]; then
      echo "reproduce.sh: error: $1 needs a value; see ./reproduce.sh --help" >&2; exit 2
    fi
    case $1 in
      --models) IFS=, read -r -a MODELS <<< "$2"; shift 2 ;;
      --seeds) SEEDS=$2; shift 2 ;;
      --seeded) IFS=, read -r -a SEEDED <<< "$2"; shift 2 ;;
      --jobs) JOBS=$2; JOBS_GIVEN=1; shift 2 ;;
      --out) OUT=$2; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      *) echo "reproduce.sh: error: unknown option $1; see ./reproduce.sh --help" >&2; exit 2 ;;
    esac
  done
  local m
  for m in "${MODELS[@]}" "${SEEDED[@]}"; do
    [[ " ${ALL_MODELS[*]} " == *" $m "* ]] || {
      echo "reproduce.sh: error: unknown model '$m'; choose from: ${ALL_MODELS[*]}" >&2; exit 2; }
  done
  [[ $SEEDS =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: error: --seeds must be a positive integer" >&2; exit 2; }
  [[ $JOBS =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: error: --jobs must be a positive integer" >&2; exit 2; }
}

wanted() { [[ " ${MODELS[*]} " == *" $1 "* ]]; }

# One line per run: "<label> <mpt-run overrides...>"; the label names its log file.
# FP16 arithmetic is emulated on CPUs (~14x slower than FP32 here), so without a GPU the reduced
# rows use pseudo_fp16: the same FP16 storage (underflow and overflow included) with FP32 math,
# which the paper (4.3) argues is numerically equivalent. On a GPU they are the real mp.
# The longest runs come first, so that the parallel lanes end together.
job_list() {
  local low=$1
  if wanted ssd; then
    row ssd fp32 experiment=quick_ssd precision=fp32
    row ssd "$low-8" experiment=quick_ssd precision="$low" scale=8
    row ssd "$low-none" experiment=quick_ssd precision="$low" scale=none
  fi
  if wanted deepspeech; then
    row deepspeech fp32 experiment=quick_deepspeech precision=fp32
    row deepspeech "$low" experiment=quick_deepspeech precision="$low" stats.enabled=true
  fi
  if wanted dcgan; then
    row dcgan fp32 experiment=quick_dcgan precision=fp32
    row dcgan "$low" experiment=quick_dcgan precision="$low"
  fi
  if wanted biglstm; then
    row biglstm fp32 experiment=quick_biglstm precision=fp32
    row biglstm "$low-128" experiment=quick_biglstm precision="$low" scale=128 stats.enabled=true stats.every=250
    row biglstm "$low-none" experiment=quick_biglstm precision="$low" scale=none stats.enabled=true stats.every=250
  fi
  if wanted resnet50; then
    row resnet50 fp32 experiment=quick_resnet50 precision=fp32
    # with gradient statistics (paper Fig. 2b/3 and 3.1): they do not change the numbers
    row resnet50 "$low" experiment=quick_resnet50 precision="$low" stats.enabled=true stats.every=50
    # torch.amp as well where FP16 math is real (on a CPU it is emulated: ~14x slower than FP32)
    if [[ $low == mp ]]; then once resnet50-amp experiment=quick_resnet50 precision=amp scale=dynamic; fi
  fi
}

# row <model> <label> <overrides...>: one run per seed for the models in --seeded, else seed 0 only
row() {
  local model=$1 label=$2 count=1 s; shift 2
  [[ " ${SEEDED[*]} " == *" $model "* ]] && count=$SEEDS
  for s in $(seq 0 $((count - 1))); do echo "$model-$label-seed$s $* seed=$s"; done
}
once() { echo "$*"; }

# Runs one job line; its output goes to <out>/logs/<label>.log. Called by xargs in parallel.
run_job() {
  local label=$1; shift
  local log=$OUT/logs/$label.log
  date +%s > "$OUT/logs/$label.started"
  local status=0
  "$VENV/bin/mpt-run" "$@" "out_root=$OUT" > "$log" 2>&1 || status=$?
  touch "$OUT/logs/$label.ended"
  rm -f "$OUT/logs/$label.started"
  if ((status)); then
    echo "   FAILED $label (exit $status): see $log" >&2
    return 1
  fi
  echo "   done  $label: $(tail -n 1 "$log" | sed 's/^.*\] - //')"
}

# Every 30 s: the runs in progress, their last logged step and an estimate of their time left.
progress() {
  local total=$1 started=$2 f label now step total_steps t0 elapsed eta
  while sleep 30; do
    now=$(date +%s)
    echo "-- $(( (now - started) / 60 ))m$(( (now - started) % 60 ))s:" \
         "$(find "$OUT/logs" -name '*.ended' | wc -l)/$total runs ended"
    for f in "$OUT"/logs/*.started; do
      t0=$(cat "$f" 2>/dev/null) || continue  # the run may end between the listing and here
      label=$(basename "$f" .started)
      step='' total_steps=''
      read -r step total_steps < <(grep -o 'step [0-9]*/[0-9]*' "$OUT/logs/$label.log" 2>/dev/null | tail -n 1 |
                                    tr '/' ' ' | cut -d' ' -f2-) || true
      elapsed=$((now - t0))
      if [[ -n ${step:-} && ${step:-0} -gt 0 ]]; then
        eta=$(( elapsed * (total_steps - step) / step ))
        echo "   $label: step $step/$total_steps, ${elapsed}s so far, about ${eta}s to go (plus evaluation)"
      else
        echo "   $label: starting (${elapsed}s)"
      fi
    done
  done
}

run_dir_of() {  # the run directory of <model>/<precision dir>, seed 0; fails when it has not finished
  local f
  f=$(find "$OUT/$1" -path '*seed0/summary.json' 2>/dev/null | sort | head -n 1)
  [[ -n $f ]] && dirname "$f"
}

# figures <mpt-figures args...> where run directories are given as <model>/<precision dir>: a run
# that failed costs its figure, not the report
figures() {
  local args=() a d
  for a in "$@"; do
    if [[ $a == */* && $a != --* && -d $OUT/${a%%/*} ]]; then
      d=$(run_dir_of "$a") || { echo "   no figure: $a has no finished seed-0 run" >&2; return 0; }
      args+=("$d")
    else
      args+=("$a")
    fi
  done
  "$VENV/bin/mpt-figures" "${args[@]}" || echo "   mpt-figures ${args[*]} failed" >&2
}

quick_reproduction() {
  local low=mp
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || low=pseudo_fp16
  # a GPU runs one job at a time unless asked: jobs sharing it would distort each other's speed
  if [[ $low == mp && $JOBS_GIVEN == 0 ]]; then JOBS=1; fi
  mkdir -p "$OUT/logs"
  rm -f "$OUT"/logs/*.started "$OUT"/logs/*.ended
  local jobs total started status=0
  jobs=$(job_list "$low")
  total=$(wc -l <<< "$jobs")
  started=$(date +%s)
  echo "== $total runs, $JOBS at a time (logs: $OUT/logs/); finished runs are reported, not retrained"
  progress "$total" "$started" &
  MONITOR=$!  # global: the EXIT trap runs outside this function
  trap 'kill "$MONITOR" 2>/dev/null || true' EXIT
  export -f run_job
  export OUT VENV
  # xargs runs the job lines JOBS at a time and exits non-zero when any of them failed
  xargs -P "$JOBS" -L 1 bash -c 'run_job "$@"' _ <<< "$jobs" || status=$?
  kill "$MONITOR" 2>/dev/null || true
  wait "$MONITOR" 2>/dev/null || true
  echo "== all runs ended in $(( ($(date +%s) - started) / 60 ))m$(( ($(date +%s) - started) % 60 ))s"

  local fig=$OUT/figures
  mkdir -p "$fig"
  # the figures side by side (each mpt-figures spends most of its time importing torch)
  if wanted resnet50; then figures "resnet50/$low" --out "$fig/resnet50" & fi
  if wanted biglstm; then
    figures "biglstm/$low-128" --out "$fig/biglstm-scale128" &
    figures "biglstm/$low" --out "$fig/biglstm-noscale" &
  fi
  if wanted dcgan; then figures --compare dcgan/fp32 "dcgan/$low" --out "$fig/dcgan_compare.png" & fi
  if wanted deepspeech; then figures "deepspeech/$low" --out "$fig/deepspeech" & fi
  wait
  echo "== FP32 vs reduced precision, with the paper's numbers ($OUT/report.md)"
  "$VENV/bin/mpt-report" "$OUT" --paper --out "$OUT/report.md" || status=$?
  echo "Outputs: $OUT (figures: $fig; tensorboard --logdir $OUT)"
  return "$status"
}

case "${1:-}" in
  test) setup; shift; run_tests "$@" ;;
  -h|--help) usage ;;
  *) parse_options "$@"; setup; quick_reproduction ;;
esac

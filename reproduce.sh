#!/usr/bin/env bash
# mpt: set up .venv (first run only) and then
#   ./reproduce.sh          the quick reproduction on built-in data, ending with FP32-vs-MP tables
#   ./reproduce.sh test     the whole CPU test suite
# Finished runs are kept and not retrained; delete outputs/reproduce/ to start over.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.mpt-installed

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
  "$VENV/bin/python" -m pip install --quiet -e '.[test]'
  echo "$want" > "$STAMP"
}

run_tests() {
  "$VENV/bin/python" -m pytest "$@"  # no paths given: pyproject testpaths (tests/)
}

quick_reproduction() {
  local out=outputs/reproduce
  run() { "$VENV/bin/mpt-run" "$@" "out_root=$out"; }  # overrides after -m: argparse wants flags first
  run_dir_of() { dirname "$(find "$out/$1" -name summary.json | sort | head -n 1)"; }  # <model>/<precision>
  echo "== ResNet-50 (narrow, synthetic images): FP32 baseline, the paper's MP, torch.amp"
  run -m experiment=quick_resnet50 precision=fp32,mp,amp
  # FP16 arithmetic is emulated on CPUs (~14x slower than FP32 here), so without a GPU the other
  # comparisons use pseudo_fp16: the same FP16 storage (underflow and overflow included) with FP32
  # math, which the paper (4.3) argues is numerically equivalent. On a GPU it is the real mp.
  local low=mp
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || low=pseudo_fp16
  echo "== SSD (reduced, synthetic detection): FP32, $low with loss scale 8, $low without scaling"
  run -m experiment=quick_ssd precision=fp32
  run -m experiment=quick_ssd precision=$low scale=8,none
  echo "== DeepSpeech 2 (tiny, synthetic speech): FP32 vs FP16 storage only (paper 4.3), gradient statistics"
  # A tiny GRU model: one thread per process is faster than two (less synchronisation per small op).
  OMP_NUM_THREADS=1 run experiment=quick_deepspeech precision=fp32
  OMP_NUM_THREADS=1 run experiment=quick_deepspeech precision=pseudo_fp16 stats.enabled=true
  if [[ $low == mp ]]; then run experiment=quick_deepspeech precision=mp; fi
  "$VENV/bin/mpt-figures" "$(run_dir_of deepspeech/pseudo_fp16)"
  echo "== Gradient statistics (paper Fig. 2b/3 and 3.1): ResNet-50, FP16 storage emulated, loss scale 8"
  run experiment=quick_resnet50 precision=pseudo_fp16 scale=8 stats.enabled=true stats.every=50
  "$VENV/bin/mpt-figures" "$(run_dir_of resnet50/pseudo_fp16-8)"
  echo "== FP32 vs reduced precision ($out/report.md)"
  "$VENV/bin/mpt-report" "$out" --out "$out/report.md"
  echo "Outputs: $out (tensorboard --logdir $out)"
}

setup
case "${1:-reproduce}" in
  test) shift; run_tests "$@" ;;
  reproduce) quick_reproduction ;;
  *) echo "usage: ./reproduce.sh [test [pytest args...]]" >&2; exit 2 ;;
esac

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
  "$VENV/bin/python" -m pytest tests "$@"
}

quick_reproduction() {
  local out=outputs/reproduce
  local run=("$VENV/bin/mpt-run" "out_root=$out")
  echo "== ResNet-50 (narrow, synthetic images): FP32 baseline, the paper's MP, torch.amp"
  "${run[@]}" -m experiment=quick_resnet50 precision=fp32,mp,amp
  if [[ -f configs/experiment/quick_ssd.yaml ]]; then
    echo "== SSD (reduced, synthetic detection): FP32, MP with loss scale 8, MP without scaling"
    "${run[@]}" -m experiment=quick_ssd precision=fp32 scale=none
    "${run[@]}" -m experiment=quick_ssd precision=mp scale=8,none
  fi
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

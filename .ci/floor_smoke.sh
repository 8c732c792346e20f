#!/usr/bin/env bash
# The floor torch's smoke selection (issue #54): the commands users run first, each on the
# oldest supported torch in its own venv. Usage: .ci/floor_smoke.sh VENV (loom installed in it).
set -euo pipefail
source "$1/bin/activate"
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
python -c "import torch; print('floor smoke on torch', torch.__version__)" >&2
smoke() {  # name, then the command; one line per command, the log only on failure
  local name=$1; shift
  local start=$SECONDS
  if ! "$@" > "$name.log" 2>&1; then
    tail -30 "$name.log" >&2
    echo "floor smoke: $name failed" >&2
    exit 1
  fi
  echo "floor smoke: $name ok ($((SECONDS - start)) s)" >&2
}
run=(loom train --model debug --dataset random --max-steps 6)
smoke one "${run[@]}" --outdir one
smoke compile "${run[@]}" --compile --outdir compiled
smoke fsdp loom launch -n 2 "${run[@]}" --checkpoint-interval 6 --outdir fsdp
smoke tp loom launch -n 2 "${run[@]}" --tp 2 --outdir tp
smoke pp loom launch -n 2 "${run[@]}" --pp 2 --outdir pp
smoke cp loom launch -n 2 "${run[@]}" --cp 2 --outdir cp
smoke ep loom launch -n 2 loom train --model moe-debug --dataset random --max-steps 6 --ep 2 \
  --outdir ep
smoke resume loom launch -n 2 loom train --model debug --dataset random --max-steps 10 --tp 2 \
  --resume --outdir fsdp
smoke export loom export fsdp/checkpoints/step-10 hf
smoke device-check env LOOM_DEVICE_CHECK=tiny python "$repo/benchmarks/device_check.py" \
  device-check --work device-check-work

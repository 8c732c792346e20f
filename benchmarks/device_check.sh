#!/usr/bin/env bash
# One run on a lent accelerator (one H200, <= 10 minutes): the figures a CPU cannot give.
#   1. bf16 training of the s and m presets, eager and compiled: tokens/s, MFU, peak memory
#   2. the six --loss-impl modes at vocab 128K and 256K, seq 8192: step time, peak memory
#   3. fused-linear's first-step time vs vocab (32K, 128K, 256K)
# Prints a table and writes JSON (default benchmarks/results/device_check.json). A run that
# does not fit (OOM) or would pass the time budget is recorded as such; the rest go on.
#
#   bash benchmarks/device_check.sh                         # on the GPU machine
#   LOOM_DEVICE_CHECK=tiny bash benchmarks/device_check.sh  # same sequence, CPU, toy sizes
# Tiny mode leaves out the compiled and loss-parallel losses (a cold inductor compile each).
# Knobs: PYTHON, LOOM_DEVICE_CHECK_RUNS (run folders), LOOM_DEVICE_CHECK_JSON,
# LOOM_DEVICE_CHECK_BUDGET_S (stop starting runs after this many seconds; default 540).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=${LOOM_DEVICE_CHECK:-gpu}
PY=${PYTHON:-python}
RUNS=${LOOM_DEVICE_CHECK_RUNS:-$(mktemp -d)}
BUDGET_S=${LOOM_DEVICE_CHECK_BUDGET_S:-540}
if [ "$MODE" = tiny ]; then
    TOY=(--dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --multiple-of 32)
    PRESET_S=("${TOY[@]}" --seq-len 64 --batch-size 1 --vocab-size 512)
    PRESET_M=()  # one preset is enough to prove the sequence
    LOSS_MODEL=("${TOY[@]}" --seq-len 64 --batch-size 1)
    LOSS_VOCABS=(512)
    LOSSES=(eager chunked chunked-backward fused-linear)  # the inductor ones cost a cold compile
    FIRST_STEP_VOCABS=(256)  # plus the loss runs' vocab
    COMPILE=(--compile --compile-backend aot_eager)
    DTYPE=auto STEPS=2 LOSS_STEPS=2 RUN_TIMEOUT=120
    JSON=${LOOM_DEVICE_CHECK_JSON:-$RUNS/device_check.json}
elif [ "$MODE" = gpu ]; then
    PRESET_S=(--model s)
    PRESET_M=(--model m)
    LOSS_MODEL=(--model s --seq-len 8192 --batch-size 1)
    LOSS_VOCABS=(128000 256128)
    LOSSES=(eager chunked chunked-backward compiled fused-linear loss-parallel)
    FIRST_STEP_VOCABS=(32000)
    COMPILE=(--compile)
    DTYPE=bf16 STEPS=30 LOSS_STEPS=6 RUN_TIMEOUT=240
    JSON=${LOOM_DEVICE_CHECK_JSON:-benchmarks/results/device_check.json}
else
    echo "error: LOOM_DEVICE_CHECK must be gpu or tiny, got '$MODE'" >&2
    exit 2
fi
mkdir -p "$RUNS"
rm -f "$RUNS/order"
START=$SECONDS

run() {  # run NAME LOOM-TRAIN-FLAGS...: one fresh `loom train`; its folder is $RUNS/NAME
    local name=$1
    shift
    if (( SECONDS - START > BUDGET_S )); then
        echo "$name" >> "$RUNS/order"
        echo "skipped: time budget spent" > "$RUNS/$name.status"
        echo "== $name: skipped (time budget)"
        return
    fi
    echo "$name" >> "$RUNS/order"
    echo "== $name: loom train $*"
    if timeout "$RUN_TIMEOUT" "$PY" -m loom train "$@" --dataset random --seed 0 \
            --dtype "$DTYPE" --outdir "$RUNS/$name" > "$RUNS/$name.log" 2>&1; then
        echo "ok" > "$RUNS/$name.status"
    else
        echo "failed (exit $?): $(grep -v '^\s*$' "$RUNS/$name.log" | tail -1)" \
            > "$RUNS/$name.status"
        echo "   $(cat "$RUNS/$name.status")"
    fi
}

for preset in s m; do
    if [ "$preset" = s ]; then flags=("${PRESET_S[@]}"); else flags=("${PRESET_M[@]}"); fi
    [ ${#flags[@]} -eq 0 ] && continue
    run "train-$preset-eager" "${flags[@]}" --max-steps "$STEPS"
    run "train-$preset-compiled" "${flags[@]}" "${COMPILE[@]}" --max-steps "$STEPS"
done
for vocab in "${LOSS_VOCABS[@]}"; do
    for loss in "${LOSSES[@]}"; do
        run "loss-$loss-v$vocab" "${LOSS_MODEL[@]}" --vocab-size "$vocab" \
            --loss-impl "$loss" --max-steps "$LOSS_STEPS"
    done
done
for vocab in "${FIRST_STEP_VOCABS[@]}"; do
    run "loss-fused-linear-v$vocab" "${LOSS_MODEL[@]}" --vocab-size "$vocab" \
        --loss-impl fused-linear --max-steps 1
done

"$PY" - "$RUNS" "$JSON" "$MODE" "$((SECONDS - START))" <<'EOF'
import json, statistics, sys
from pathlib import Path

runs, out, mode, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
results = []
for name in (runs / "order").read_text().split():
    folder = runs / name
    row = {"run": name, "status": (runs / f"{name}.status").read_text().strip()}
    metrics = folder / "metrics-0.jsonl"
    if row["status"] == "ok" and metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        config = json.loads((folder / "config.json").read_text())
        steady = rows[1:] or rows
        mfu = [r["train/mfu"] for r in steady if r.get("train/mfu") is not None]
        row.update(
            loss_impl=config["loss"]["loss_impl"], vocab=config["model"]["vocab_size"],
            dtype=config["parallel"]["dtype"], device=config["device"],
            first_step_s=rows[0]["train/dt"],
            step_s=statistics.median(r["train/dt"] for r in steady),
            tokens_per_s=statistics.median(r["train/tps"] for r in steady),
            mfu=statistics.median(mfu) if mfu else None,
            peak_mem_gib=max(r.get("train/mem_alloc_peak", r.get("train/mem_rss_peak", 0))
                             for r in rows))
    results.append(row)
print("| run | loss impl | vocab | step s | first step s | tok/s | MFU % | peak GiB | status |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
fmt = lambda v, f: "-" if v is None else format(v, f)
for r in results:
    print(f"| {r['run']} | {r.get('loss_impl', '-')} | {r.get('vocab', '-')} | "
          f"{fmt(r.get('step_s'), '.3f')} | {fmt(r.get('first_step_s'), '.2f')} | "
          f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.1f')} | "
          f"{fmt(r.get('peak_mem_gib'), '.2f')} | {r['status']} |")
print(f"\n{mode} mode, {seconds} s")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"mode": mode, "seconds": seconds, "runs": results}, indent=1) + "\n")
EOF

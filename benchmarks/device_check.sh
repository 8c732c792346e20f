#!/usr/bin/env bash
# One run on a lent accelerator (one H200, <= 10 minutes): the figures a CPU cannot give.
#   1. bf16 training of the s, m, xl and agpt-2b presets, compiled, each with the lightest
#      --ac that `loom plan` says fits (none, then op, then block): tokens/s, MFU, peaks
#   2. the loss-mode table: agpt-2b (vocab 256K, seq 8192) at batch 1 and 2 with each
#      --loss-impl that differs on one device: step time, allocated and reserved peaks
#   3. `loom plan` of every run above (same flags, world size 1, this device): its step
#      time and peak against the measured ones, as errors in percent
# Prints a table and writes JSON (default benchmarks/results/device_check.json) and the
# same table as markdown beside it (.md, for the README). A run that does not fit (OOM) or
# would pass the time budget is recorded as such; the rest go on.
#
#   bash benchmarks/device_check.sh                         # on the GPU machine
#   LOOM_DEVICE_CHECK=tiny bash benchmarks/device_check.sh  # same sequence, CPU, toy sizes
# Tiny mode runs one toy preset and the eager-compilable losses (a cold inductor compile
# each is too slow for a test). Knobs: PYTHON, LOOM_DEVICE_CHECK_RUNS (run folders),
# LOOM_DEVICE_CHECK_JSON, LOOM_DEVICE_CHECK_BUDGET_S (stop starting runs after this many
# seconds; default 480: the plans run beside the trainings and are awaited at the end).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=${LOOM_DEVICE_CHECK:-gpu}
PY=${PYTHON:-python}
RUNS=${LOOM_DEVICE_CHECK_RUNS:-$(mktemp -d)}
BUDGET_S=${LOOM_DEVICE_CHECK_BUDGET_S:-480}
if [ "$MODE" = tiny ]; then
    TOY=(--dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --multiple-of 32)
    PRESETS=(s)
    preset_flags() { echo "${TOY[@]}" --seq-len 64 --batch-size 1 --vocab-size 512; }
    LOSS_MODEL=("${TOY[@]}" --seq-len 64 --vocab-size 512)
    LOSSES=(eager chunked fused-linear)  # enough to prove the table; inductor: a cold compile
    LOSS_BATCHES=(1 2)
    COMPILE=(--compile --compile-backend aot_eager)
    DTYPE=auto STEPS=3 LOSS_STEPS=2 RUN_TIMEOUT=120
    PLAN_DEVICE=(--device cpu --device-memory 64GiB)
    JSON=${LOOM_DEVICE_CHECK_JSON:-$RUNS/device_check.json}
elif [ "$MODE" = gpu ]; then
    PRESETS=(s m xl agpt-2b)
    preset_flags() { echo --model "$1"; }
    LOSS_MODEL=(--model agpt-2b --seq-len 8192)
    # loss-parallel needs tp > 1: on one device it runs as compiled, so it is left out
    LOSSES=(eager chunked chunked-backward compiled fused-linear)
    LOSS_BATCHES=(1 2)
    COMPILE=(--compile)
    DTYPE=bf16 STEPS=20 LOSS_STEPS=4 RUN_TIMEOUT=180
    read -r GPU_NAME GPU_BYTES < <("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(p.name.split()[-1], p.total_memory)")
    PLAN_DEVICE=(--device "$GPU_NAME" --device-memory "$GPU_BYTES")
    JSON=${LOOM_DEVICE_CHECK_JSON:-benchmarks/results/device_check.json}
else
    echo "error: LOOM_DEVICE_CHECK must be gpu or tiny, got '$MODE'" >&2
    exit 2
fi
mkdir -p "$RUNS"
rm -f "$RUNS/order"
START=$SECONDS

plan() {  # plan [--choose-ac] < "NAME<TAB>FLAGS" lines: `loom plan` of each, in one process
    OMP_NUM_THREADS=2 timeout "$RUN_TIMEOUT" "$PY" benchmarks/plan_runs.py "$RUNS" "$@" -- \
        --dtype "$DTYPE" --world-size 1 "${PLAN_DEVICE[@]}"
}

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

for preset in "${PRESETS[@]}"; do  # the lightest recompute the plan says fits
    printf 'train-%s-compiled\t%s\n' "$preset" "$(preset_flags "$preset") ${COMPILE[*]}"
done | plan --choose-ac
for preset in "${PRESETS[@]}"; do
    read -r -a flags <<< "$(preset_flags "$preset")"
    name="train-$preset-compiled"
    ac=$(cat "$RUNS/$name.ac" 2> /dev/null || echo block)
    run "$name" "${flags[@]}" "${COMPILE[@]}" --ac "$ac" --max-steps "$STEPS"
done
for batch in "${LOSS_BATCHES[@]}"; do
    for loss in "${LOSSES[@]}"; do
        printf 'loss-%s-b%s\t%s\n' "$loss" "$batch" \
            "${LOSS_MODEL[*]} --batch-size $batch --loss-impl $loss"
    done
done | plan &  # the CPU plans while the device trains
for batch in "${LOSS_BATCHES[@]}"; do
    for loss in "${LOSSES[@]}"; do
        run "loss-$loss-b$batch" "${LOSS_MODEL[@]}" --batch-size "$batch" \
            --loss-impl "$loss" --max-steps "$LOSS_STEPS"
    done
done
wait

"$PY" - "$RUNS" "$JSON" "$MODE" "$((SECONDS - START))" <<'EOF'
import json, statistics, sys
from pathlib import Path

runs, out, mode, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])


def error(predicted, measured):
    """Percent by which the plan is off the measurement (None when either is missing)."""
    if predicted is None or not measured:
        return None
    return 100 * (predicted - measured) / measured


results = []
for name in (runs / "order").read_text().split():
    folder = runs / name
    row = {"run": name, "status": (runs / f"{name}.status").read_text().strip()}
    ac = runs / f"{name}.ac"
    if ac.is_file():
        row["ac"] = ac.read_text().strip()
    try:
        plan = json.loads((runs / f"{name}.plan.json").read_text())
        row.update(plan_step_s=plan["step_time_s"], plan_peak_gib=plan["peak_gib"])
    except (OSError, ValueError, KeyError):
        row.update(plan_step_s=None, plan_peak_gib=None)
    metrics = folder / "metrics-0.jsonl"
    if row["status"] == "ok" and metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        config = json.loads((folder / "config.json").read_text())
        steady = rows[2:] if len(rows) > 3 else rows[1:] or rows  # compile's first steps
        mfu = [r["train/mfu"] for r in steady if r.get("train/mfu") is not None]
        peak = lambda key: max((r[key] for r in rows if key in r), default=None)
        row.update(
            loss_impl=config["loss"]["loss_impl"], vocab=config["model"]["vocab_size"],
            batch=config["train"]["batch_size"], dtype=config["parallel"]["dtype"],
            ac=config["parallel"]["activation_checkpoint"], device=config["device"],
            first_step_s=rows[0]["train/dt"],
            step_s=statistics.median(r["train/dt"] for r in steady),
            tokens_per_s=statistics.median(r["train/tps"] for r in steady),
            mfu=statistics.median(mfu) if mfu else None,
            alloc_peak_gib=peak("train/mem_alloc_peak") or peak("train/mem_rss_peak"),
            reserved_peak_gib=peak("train/mem_reserved_peak"))
        row["step_err_pct"] = error(row["plan_step_s"], row["step_s"])
        row["alloc_err_pct"] = error(row["plan_peak_gib"], row["alloc_peak_gib"])
        row["reserved_err_pct"] = error(row["plan_peak_gib"], row["reserved_peak_gib"])
    results.append(row)
fmt = lambda v, f: "-" if v is None else format(v, f)
lines = ["| run | ac | loss impl | batch | step s | first step s | tok/s | MFU % | alloc peak "
         "GiB | reserved peak GiB | plan step s (err %) | plan peak GiB (err % alloc / "
         "reserved) | status |",
         "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
for r in results:
    lines.append(
        f"| {r['run']} | {r.get('ac', '-')} | {r.get('loss_impl', '-')} | {r.get('batch', '-')} | "
        f"{fmt(r.get('step_s'), '.3f')} | {fmt(r.get('first_step_s'), '.2f')} | "
        f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.1f')} | "
        f"{fmt(r.get('alloc_peak_gib'), '.2f')} | {fmt(r.get('reserved_peak_gib'), '.2f')} | "
        f"{fmt(r.get('plan_step_s'), '.3f')} ({fmt(r.get('step_err_pct'), '+.0f')}) | "
        f"{fmt(r.get('plan_peak_gib'), '.2f')} ({fmt(r.get('alloc_err_pct'), '+.0f')} / "
        f"{fmt(r.get('reserved_err_pct'), '+.0f')}) | {r['status']} |")
print("\n".join(lines))
print(f"\n{mode} mode, {seconds} s")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"mode": mode, "seconds": seconds, "runs": results}, indent=1) + "\n")
out.with_suffix(".md").write_text("\n".join(lines) + "\n")
EOF

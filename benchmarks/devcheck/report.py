"""The device check's derived columns (MFU against both peaks, ratios to the baselines, the
plan's errors) and its short table. Ratios are throughput ratios: above 1, loom is faster."""

from __future__ import annotations

GOALS = {"s-b4": 35.0, "xl": 50.0, "agpt-2b": 45.0}
"""MFU (%, datasheet peak) each row should reach (issue #54)."""


def ratio(base_s: float | None, step_s: float | None) -> float | None:
    return base_s / step_s if base_s and step_s else None


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    return 100 * (predicted - measured) / measured if predicted and measured else None


def derive(record: dict, matmul_tflops: float | None, done: dict[str, dict]) -> dict:
    """Add MFU, ratios and plan errors to a row's record (in place; returned)."""
    loom = record.get("loom", {})
    step, flops = loom.get("step_s"), loom.get("flops_per_step")
    if step and flops:
        record["mfu_datasheet_pct"] = 100 * flops / step / loom["loom_peak_flops"]
        if matmul_tflops:
            record["mfu_matmul_pct"] = 100 * flops / step / (matmul_tflops * 1e12)
        if record["row"] in GOALS:
            record["mfu_goal_pct"] = GOALS[record["row"]]
    record["vs_plain"] = ratio(record.get("plain", {}).get("step_s"), step)
    record["vs_titan"] = ratio(record.get("titan", {}).get("step_s"), step)
    base = record.get("base")
    if base:
        record["vs_base"] = ratio(done.get(base, {}).get("loom", {}).get("step_s"), step)
    plan = record.get("plan") or {}
    record["plan_step_err_pct"] = error_pct(plan.get("plan_step_s"), step)
    record["plan_peak_err_pct"] = error_pct(plan.get("plan_peak_gib"),
                                            loom.get("reserved_peak_gib")
                                            or loom.get("alloc_peak_gib"))
    return record


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def short(status: str | None) -> str:
    return "-" if status is None else status[:60]


HEADER = ("| row | ac | step ms | tok/s | MFU % sheet / matmul | vs plain | vs titan | vs base "
          "| peak GiB | plan ms (err %) | plan GiB (err %) | loom / plain / titan |")


def table(records: list[dict]) -> str:
    lines = [HEADER, "| --- | --- |" + " ---: |" * 9 + " --- |"]
    for r in records:
        loom, plan = r.get("loom", {}), r.get("plan") or {}
        status = " / ".join(short(r.get(k, {}).get("status")) for k in ("loom", "plain", "titan"))
        peak = loom.get("reserved_peak_gib") or loom.get("alloc_peak_gib")
        step_ms = loom.get("step_s") and 1e3 * loom["step_s"]
        plan_ms = plan.get("plan_step_s") and 1e3 * plan["plan_step_s"]
        lines.append(
            f"| {r['row']} | {r.get('ac', '-')} | {fmt(step_ms, '.1f')} "
            f"| {fmt(loom.get('tokens_per_s'), ',.0f')} "
            f"| {fmt(r.get('mfu_datasheet_pct'), '.1f')} / {fmt(r.get('mfu_matmul_pct'), '.1f')} "
            f"| {fmt(r.get('vs_plain'), '.2f')} | {fmt(r.get('vs_titan'), '.2f')} "
            f"| {fmt(r.get('vs_base'), '.2f')} | {fmt(peak, '.2f')} "
            f"| {fmt(plan_ms, '.1f')} "
            f"({fmt(r.get('plan_step_err_pct'), '+.0f')}) "
            f"| {fmt(plan.get('plan_peak_gib'), '.2f')} "
            f"({fmt(r.get('plan_peak_err_pct'), '+.0f')}) "
            f"| {status} |")
    return "\n".join(lines)

"""The one-run check for a lent GPU (one H200, <= 8 minutes, under that machine's python3):
loom's rows beside a plain compiled PyTorch loop and torchtitan, on the same GPU.

    python3 benchmarks/device_check.py OUT              # on the GPU machine: OUT=$OUT
    LOOM_DEVICE_CHECK=tiny python3 benchmarks/device_check.py OUT   # CPU rehearsal, toy sizes

Writes into OUT, as each row finishes: rows.jsonl (one JSON line per row, appended) and
device_check.json (everything so far, replaced whole); at the end device_check.md (the
table), profile.json (the s trace's summary). Prints the table last on stdout; logs go to
stderr; every child's output stays in --work. A row past its own limit or the global budget
is recorded as such and the check goes on. Carried wheels in .whl/ (benchmarks/
device_wheels.sh) are installed with pip --no-index --no-deps --target first. Rows and
their order: benchmarks/devcheck/catalogue.py; docs/performance.md says what each means.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from devcheck import proc, report
from devcheck.catalogue import Row, rows_for
from devcheck.loomrow import run_loom
from devcheck.trace import summarise

HERE = Path(__file__).resolve().parent
MODES = {"gpu": {"budget_s": 500, "matmul_n": 8192, "threads": None},
         "tiny": {"budget_s": 170, "matmul_n": 512, "threads": 2}}


def log(message: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Out:
    """OUT: rows appended one line at a time (a killed check leaves whole lines), the JSON
    replaced whole through a temporary file and a rename."""

    def __init__(self, folder: Path, meta: dict):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.meta, self.records = folder, meta, []
        (folder / "rows.jsonl").write_text("")

    def add(self, record: dict) -> None:
        self.records.append(record)
        fd = os.open(self.folder / "rows.jsonl", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.write("device_check.json", json.dumps({**self.meta, "rows": self.records},
                                                   indent=1) + "\n")

    def write(self, name: str, text: str) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.folder / name)


def gpu_identity() -> tuple[str, int] | None:
    """The GPU's full name and memory from nvidia-smi: the check takes no GPU for this."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    name, mib = (part.strip() for part in line.rsplit(",", 1))
    return name, int(float(mib)) * 2**20


def install_wheels(site: Path) -> str | None:
    """pip-install the carried wheels that fit this Python into `site`; None or the error."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours = set(sys_tags())
    wheels = [str(w) for w in sorted((HERE.parent / ".whl").glob("*.whl"))
              if ours & set(parse_wheel_filename(w.name)[3])]
    if not wheels:
        return "no carried wheels (.whl/): run benchmarks/device_wheels.sh here first"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                           "--target", str(site), *wheels], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def run_plans(rows: list[Row], plan_flags: list[str], work: Path, env: dict, timeout_s: float
              ) -> dict[str, dict]:
    """`loom plan` of every row that has one, in a few processes at once (CPU only)."""
    requests = [{"name": r.name, "flags": list(r.flags), "choose_ac": r.ac == "plan",
                 "ac": "none" if r.ac == "plan" else r.ac}
                for r in rows if r.plan]
    workers = max(1, min(4, (os.cpu_count() or 2) // 4))
    chunks = [requests[i::workers] for i in range(workers)]
    results = work / "plans.jsonl"
    procs = []
    for i, chunk in enumerate(chunks):
        path = work / f"plan-requests-{i}.json"
        path.write_text(json.dumps(chunk))
        with open(work / f"plans-{i}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "devcheck" / "plans.py"), str(path),
                 str(results), "--", *plan_flags], env=env, cwd=HERE.parent,
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    plans = {}
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            plans[record["row"]] = record
    return plans


class Check:
    def __init__(self, args: argparse.Namespace, out: Out, env: dict, budget_s: float):
        self.args, self.out, self.env = args, out, env
        self.deadline = time.monotonic() + budget_s
        self.done: dict[str, dict] = {}
        self.matmul_tflops: float | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def child(self, what: str, argv: list[str], limit_s: float) -> tuple[dict, dict]:
        """Run a baseline script; its JSON result with a status, or why not."""
        if self.left() < 10:
            return {"status": "skipped: global budget spent"}, {}
        c = proc.run(argv, min(limit_s, self.left()), self.args.work / "logs" / what, self.env)
        result = c.last_json() if c.ok else None
        if result is None:
            return {"status": f"failed: {c.why()}", "wall_s": c.seconds}, {}
        return {"status": "ok", "wall_s": c.seconds, **result}, result

    def row(self, row: Row, plans: dict[str, dict]) -> dict:
        record: dict = {"row": row.name, "flags": list(row.flags), "steps": row.steps,
                        "warmup": row.warmup, "base": row.base, "notes": list(row.notes),
                        "plan": plans.get(row.name)}
        ac = row.ac
        if ac == "plan":
            plan = plans.get(row.name)
            if not plan or not plan.get("ok"):
                why = plan["error"] if plan else "no plan (plan budget spent)"
                record["loom"] = {"status": f"not run: loom plan gave no --ac: {why}"}
                return record
            ac = plan["ac"]
        record["ac"] = ac
        if self.left() < 15:
            record["loom"] = {"status": "skipped: global budget spent"}
            return record
        log(f"{row.name}: loom train --ac {ac} {' '.join(row.flags)}")
        loom, child = run_loom(row, ac, self.args.work, min(row.budget_s, self.left()), self.env)
        loom["wall_s"] = child.seconds
        record["loom"] = loom
        log(f"{row.name}: loom {loom['status']} ({child.seconds:.0f} s)")
        if row.profile_wait and loom["status"] == "ok":
            record["profile"] = self.profile(row)
        compiled = "--compile" in row.flags
        backend = "aot_eager" if self.args.mode == "tiny" else "inductor"
        spec = {"flags": list(row.flags), "steps": row.steps, "warmup": row.warmup,
                "ac": ac, "compile": compiled, "compile_backend": backend}
        if row.plain:  # run whatever loom did: the baseline says whether the shape runs
            record["plain"], _ = self.child(f"{row.name}-plain", [
                str(HERE / "devcheck" / "plain.py"), json.dumps(spec)], row.budget_s)
            log(f"{row.name}: plain loop {record['plain']['status']}")
        if row.titan:
            record["titan"] = self.titan(row, {**spec, "compile": compiled and
                                               self.args.mode == "gpu"})
            log(f"{row.name}: torchtitan {record['titan']['status']}")
        return report.derive(record, self.matmul_tflops, self.done)

    def titan(self, row: Row, spec: dict) -> dict:
        """torchtitan on the row's shape; compiled on the GPU only (in the rehearsal a cold
        compile of its model and loss would cost more than the row's budget on two cores)."""
        if self.args.titan_error:
            return {"status": f"not run: {self.args.titan_error}"}
        result, _ = self.child(f"{row.name}-titan", [str(HERE / "devcheck" / "titan.py"),
                                                     json.dumps(spec)], row.budget_s)
        return result

    def profile(self, row: Row) -> dict:
        traces = sorted((self.args.work / row.name / "profile").glob("trace-*.json"))
        if not traces:
            return {"error": "no trace written"}
        summary = summarise(traces[0])
        self.out.write("profile.json", json.dumps(summary, indent=1) + "\n")
        return {k: summary.get(k) for k in ("gpu_idle_fraction", "sdpa_ops", "sdpa_kernels",
                                             "span_ms", "steps")}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder the rows are written to (created)")
    parser.add_argument("--tiny", action="store_true",
                        help="the CPU rehearsal (also LOOM_DEVICE_CHECK=tiny)")
    parser.add_argument("--budget-s", type=float, help="global limit (default: 500 gpu, 170 tiny)")
    parser.add_argument("--rows", nargs="+", help="only these rows (catalogue names)")
    parser.add_argument("--work", type=Path, help="scratch folder for run folders and logs")
    parser.add_argument("--no-wheels", action="store_true", help="skip installing .whl/")
    args = parser.parse_args(argv)
    mode = os.environ.get("LOOM_DEVICE_CHECK", "tiny" if args.tiny else "gpu")
    if mode not in MODES:
        parser.exit(2, f"error: LOOM_DEVICE_CHECK must be gpu or tiny, got {mode!r}\n")
    args.mode = "tiny" if args.tiny else mode
    unknown = set(args.rows or ()) - {r.name for r in rows_for(args.mode)}
    if unknown:
        parser.exit(2, f"error: no such {args.mode} row: {', '.join(sorted(unknown))}\n")
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="device-check-"))).resolve()
    args.out = args.out.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def setup(args: argparse.Namespace, t0: float) -> tuple[dict, dict, list[Row]]:
    """Identity, wheels, environment; the meta every output carries."""
    mode = MODES[args.mode]
    rows = [r for r in rows_for(args.mode) if not args.rows or r.name in args.rows]
    identity = gpu_identity() if args.mode == "gpu" else None
    if args.mode == "gpu" and identity is None:
        print("error: nvidia-smi found no GPU; on a CPU run LOOM_DEVICE_CHECK=tiny",
              file=sys.stderr)
        sys.exit(2)
    site = args.work / "site"
    wheels_error = "not installed (--no-wheels)" if args.no_wheels else install_wheels(site)
    env = proc.child_env(str(site) if site.exists() else None, mode["threads"])
    probe = subprocess.run([sys.executable, str(HERE / "devcheck" / "titan.py"), "--probe"],
                           env=env, capture_output=True, text=True, cwd=HERE.parent)
    args.titan_error = None if probe.returncode == 0 else (
        "torchtitan does not import here: "
        + (probe.stderr.strip().splitlines() or ["?"])[-1])[:300]
    meta = {"mode": args.mode, "device": identity[0] if identity else "cpu",
            "device_memory_bytes": identity[1] if identity else None,
            "budget_s": args.budget_s or mode["budget_s"], "wheels": wheels_error or "installed",
            "torchtitan": args.titan_error or f"imports: {probe.stdout.strip()}",
            "commit": git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "complete": False}
    return meta, env, rows


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=HERE.parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse(argv)
    meta, env, rows = setup(args, t0)
    out = Out(args.out, meta)
    budget = meta["budget_s"] - (time.monotonic() - t0)
    check = Check(args, out, env, budget)
    log(f"{args.mode}: {len(rows)} rows, {budget:.0f} s; scratch {args.work}")
    out.add({"row": "setup", **meta, "seconds": time.monotonic() - t0})
    memory = meta["device_memory_bytes"] or 64 * 2**30
    plan_flags = ["--dtype", "bf16", "--world-size", "1", "--device",
                  meta["device"], "--device-memory", str(memory)]
    plans = run_plans(rows, plan_flags, args.work, env, min(90.0, check.left() / 3))
    out.add({"row": "plans", "planned": sorted(plans), "flags": plan_flags,
             "seconds": time.monotonic() - t0})
    mm, _ = check.child("matmul", [str(HERE / "devcheck" / "matmul.py"),
                                   str(MODES[args.mode]["matmul_n"])], 60)
    check.matmul_tflops = mm.get("matmul_tflops")
    out.add({"row": "matmul", **mm})
    for row in rows:
        record = check.row(row, plans)
        check.done[row.name] = {"ac": record.get("ac"), "loom": record.get("loom", {})}
        out.add(record)
    meta.update(complete=True, seconds=time.monotonic() - t0)
    out.add({"row": "end", "seconds": meta["seconds"]})
    text = report.table([r for r in out.records if "loom" in r])
    out.write("device_check.md", text + "\n")
    print(text)
    print(f"\n{args.mode}: {meta['device']}, torch {mm.get('torch', '?')}, matmul "
          f"{report.fmt(check.matmul_tflops, '.3g')} TFLOP/s, {meta['seconds']:.0f} s; "
          f"rows in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

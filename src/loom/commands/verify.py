"""`loom verify --layouts L1 L2 ... [--steps N] [train flags]`: do these parallel layouts
train the same model?

Every layout trains from the same seed and the same global batch, in turn, on every rank of
the job; then the first layout is the reference and each other one is compared with it: the
per-step loss and pre-clip gradient norm (largest relative difference over the steps) and
the final parameters (per tensor ||a - b|| / ||b||, largest over tensors, and the first
parameter in model order beyond the tolerance). One table on stdout (or `--json`); the
trainings' logs go to stderr. Exit 0 when every layout agrees, 1 when one does not, 2 on
bad input. Options: --layouts (required), --steps [5], --global-batch-size [the world
size], --rtol [1e-5] (loss), --grad-rtol [1e-4] (pre-clip gradient norm), --param-rtol
[1e-3], --outdir [outputs/verify-<timestamp>; one run folder per layout], --json; every
other flag goes to `loom train`. The gradient norm gets 10x the loss's tolerance: after a few
AdamW steps, summation-order differences of near-zero gradients flip update signs, and the
norm moves (measured 3.4e-5 at tp2 against dp2, lr 3e-3, step 3) where a wrong gradient
scale moves it by tens of percent.

Layout grammar: space-separated degrees, then optional flags for that layout only.
  dp N -> --dp-shard N     dpr N -> --dp-replicate N     hsdp RxS -> both
  tp N, pp N, cp N, ep N, etp N -> --tp, --pp, --cp, --ep, --etp
  written without a space: "dp2 tp2", "hsdp2x2 ep2", "pp2 dp2", "dp4 --lr 2e-3"
A degree a layout does not name takes its default (dp-shard: the remaining ranks, others 1).
Every layout runs on all ranks of the job: one that needs fewer (e.g. "1", a single-process
reference) is refused in one line, as sub-groups are not supported. Layouts are compared at
one world size; `loom launch -n 1 loom verify --layouts dp1 ...` is the single-process run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from loom.config import ConfigError, JobConfig, parse_args
from loom.errors import BAD_INPUT_EXIT, FAILURE_EXIT
from loom.models.registry import routing_of
from loom.observability.metrics import read_rows
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo, process_group, rank_info
from loom.runtime.logs import logging_scope
from loom.runtime.watchdog import watch_launcher, write_error_file
from loom.trainer.parity import layout_training, whole_model
from loom.trainer.resolve import resolve_model

logger = logging.getLogger("loom")

DEGREES = {"dp": "dp_shard", "dpr": "dp_replicate", "tp": "tp", "pp": "pp", "cp": "cp",
           "ep": "ep", "etp": "etp"}
"""Layout token prefix -> the ParallelConfig field it sets."""
DEFAULT_DEGREES = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1, "ep": 1,
                   "etp": 1}
"""What a layout leaves unnamed: each layout is the whole layout, not a change to the last."""
VERIFY_SETS = ("batch_size", "max_steps", "outdir", *DEFAULT_DEGREES)
"""Training fields `loom verify` sets per layout, so they cannot be given as train flags."""
MOE_NOTE = ("MoE: a token whose top-k router scores nearly tie can be routed to other "
            "experts under another layout (a different reduction order), which moves the loss "
            "beyond the tolerance without a bug; a difference that starts at a step where "
            "moe/tokens_per_expert_* differ is likely that.")


@dataclass(frozen=True)
class Layout:
    """One layout: what the user wrote and the train flags it stands for."""

    text: str
    flags: tuple[str, ...]


def parse_layout(text: str) -> Layout:
    """'dp2 tp2 --lr 2e-3' -> --dp-shard 2 --tp 2 (other degrees at their defaults) --lr 2e-3."""
    tokens = shlex.split(text)
    split = next((i for i, t in enumerate(tokens) if t.startswith("--")), len(tokens))
    degrees = dict(DEFAULT_DEGREES)
    if not tokens[:split]:
        raise ConfigError(f"layout {text!r} names no degree (e.g. 'dp4', 'dp2 tp2')")
    for token in tokens[:split]:
        hsdp = re.fullmatch(r"hsdp(\d+)x(\d+)", token)
        match = re.fullmatch(r"([a-z]+)(\d+)", token)
        if hsdp:
            degrees["dp_replicate"], degrees["dp_shard"] = int(hsdp[1]), int(hsdp[2])
        elif match and match[1] in DEGREES:
            degrees[DEGREES[match[1]]] = int(match[2])
        else:
            raise ConfigError(f"layout {text!r}: cannot read {token!r}; write degrees as "
                              f"{', '.join(f'{k}N' for k in DEGREES)} or hsdpRxS")
    flags = [f for name, n in degrees.items() for f in (f"--{name.replace('_', '-')}", str(n))]
    return Layout(text, (*flags, *tokens[split:]))


def verify_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loom verify", add_help=False)
    parser.add_argument("--layouts", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--grad-rtol", type=float, default=1e-4)
    parser.add_argument("--param-rtol", type=float, default=1e-3)
    parser.add_argument("--outdir", type=str, default=None)
    parser.add_argument("--json", action="store_true")
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


@dataclass(frozen=True)
class Request:
    """The validated request: each layout's full `loom train` flags, and the options."""

    layouts: list[Layout]
    argvs: list[list[str]]
    options: argparse.Namespace
    base: JobConfig


def parse_request(argv: Sequence[str], world_size: int) -> Request:
    """Every layout checked against the world size and the global batch before any
    collective: bad input fails on every rank alike, in one line."""
    options, train_argv = verify_parser().parse_known_args(list(argv))
    if options.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {options.steps}")
    base = parse_args(train_argv)
    resolve_model(base)  # a Hugging Face --model's folder is checked before any layout runs
    clash = [f"--{n.replace('_', '-')}" for n in VERIFY_SETS if n in base.explicit]
    if clash:
        raise ConfigError(f"{', '.join(clash)}: loom verify sets these per layout (use "
                          "--layouts, --steps, --global-batch-size, --outdir)")
    layouts = [parse_layout(text) for text in options.layouts]
    batch = options.global_batch_size or world_size
    argvs = [layout_argv(layout, train_argv, batch, world_size, options.steps)
             for layout in layouts]
    return Request(layouts, argvs, options, base)


def layout_argv(layout: Layout, train_argv: Sequence[str], global_batch: int,
                world_size: int, steps: int) -> list[str]:
    """The layout's `loom train` flags, with the per-dp-rank batch that keeps the global
    batch the same in every layout."""
    argv = [*train_argv, *layout.flags, "--max-steps", str(steps), "--metrics"]
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        raise ConfigError(f"layout {layout.text!r}: {e}") from None
    try:
        dims = ParallelDims.from_config(cfg.parallel, world_size)
    except ConfigError as e:
        raise ConfigError(f"layout {layout.text!r}: {e} (every layout runs on all "
                          f"{world_size} ranks of the job)") from None
    if global_batch % dims.dp_size:
        raise ConfigError(f"layout {layout.text!r}: --global-batch-size {global_batch} is not "
                          f"divisible by its data-parallel size {dims.dp_size}")
    return [*argv, "--batch-size", str(global_batch // dims.dp_size)]


@dataclass
class Outcome:
    """What one layout ended with (rank 0)."""

    losses: dict[int, float]
    grad_norms: dict[int, float]
    params: dict[str, torch.Tensor]


@dataclass
class Verdict:
    """One row of the table: largest relative differences from the reference layout."""

    layout: str
    loss: float
    grad_norm: float
    params: float
    worst_param: str | None
    first_differing: str | None
    ok: bool
    beyond: tuple[str, ...] = ()
    """Which of loss and gradient norm are beyond their tolerance."""


def largest_relative(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest |a - b| / |b| over the steps both have; inf when the steps differ."""
    if sorted(a) != sorted(b):
        return float("inf")
    return max((abs(a[s] - b[s]) / max(abs(b[s]), 1e-30) for s in b), default=0.0)


def parameter_differences(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                          ) -> dict[str, float]:
    """Per tensor, in the reference's order: ||a - b|| / ||b|| (inf when missing or of
    another shape). Norm-wise, since AdamW can turn a reduction-order difference on a ~0
    gradient into a 2 * lr step of one element."""
    out = {}
    for name, ref in reference.items():
        mine = params.get(name)
        if mine is None or mine.shape != ref.shape:
            out[name] = float("inf")
            continue
        out[name] = float((mine.double() - ref.double()).norm()
                          / ref.double().norm().clamp(min=1e-30))
    return out


def compare(text: str, outcome: Outcome, reference: Outcome, rtol: float, grad_rtol: float,
            param_rtol: float) -> Verdict:
    """The verdict of one layout against the reference; it passes when every difference is
    within its tolerance and both have the same parameters."""
    loss = largest_relative(outcome.losses, reference.losses)
    grad = largest_relative(outcome.grad_norms, reference.grad_norms)
    diffs = parameter_differences(outcome.params, reference.params)
    extra = sorted(set(outcome.params) - set(reference.params))
    worst = max(diffs, key=diffs.get, default=None)
    first = next((n for n, d in diffs.items() if not d <= param_rtol), extra[0] if extra else None)
    top = diffs[worst] if worst is not None else 0.0
    beyond = [name for name, diff, tol in (("loss", loss, rtol), ("grad norm", grad, grad_rtol))
              if not diff <= tol]
    ok = not beyond and first is None
    return Verdict(text, loss, grad, top, worst, first, ok, tuple(beyond))


def format_table(verdicts: list[Verdict], reference: str, notes: list[str]) -> str:
    """The table: one row per layout, the reference first."""
    width = max(len(reference), *(len(v.layout) for v in verdicts))
    head = (f"{'layout':<{width}}  {'loss':>9}  {'grad norm':>9}  {'params':>9}  "
            f"{'result':<6}  first parameter beyond tolerance")
    rows = [head, f"{reference:<{width}}  {'reference':>9}"]
    for v in verdicts:
        rows.append(f"{v.layout:<{width}}  {v.loss:9.2e}  {v.grad_norm:9.2e}  {v.params:9.2e}  "
                    f"{'pass' if v.ok else 'FAIL':<6}  {last_column(v)}")
    return "\n".join(rows + [f"note: {n}" for n in notes])


def last_column(v: Verdict) -> str:
    """The first differing parameter; else, for a failing layout, what was beyond tolerance."""
    if v.first_differing or v.ok:
        return v.first_differing or "-"
    return f"- ({', '.join(v.beyond)} beyond tolerance)"


def notes_for(cfg: JobConfig, options: argparse.Namespace) -> list[str]:
    """What the reader needs to judge the numbers."""
    notes = [f"largest relative differences from the first layout over {options.steps} steps "
             f"(loss: tolerance {options.rtol:g}; pre-clip gradient norm: {options.grad_rtol:g})"
             " and of the final parameters, per tensor ||a-b||/||b|| (tolerance "
             f"{options.param_rtol:g})"]
    if cfg.parallel.dtype != "fp32":
        notes.append("not --fp32: mixed precision rounds differently per layout; expect "
                     "~1e-2 and compare under --fp32")
    if routing_of(cfg.model):
        notes.append(MOE_NOTE)
    return notes


def read_outcome(trainer_outdir: Path, params: dict[str, torch.Tensor]) -> Outcome:
    """Rank 0's per-step loss and gradient norm from the run folder, with the parameters."""
    rows = read_rows(trainer_outdir / "metrics-0.jsonl")
    return Outcome({r["train/iter"]: r["train/loss"] for r in rows},
                   {r["train/iter"]: r["grad/norm_preclip"] for r in rows}, params)


def agree_on_root(outdir: str | None) -> Path:
    """The given folder, or outputs/verify-<timestamp> chosen by rank 0 for every rank."""
    chosen = [outdir or f"outputs/verify-{datetime.now():%Y-%m-%d-%H%M%S}"]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def run_layouts(request: Request, info: RankInfo, device: torch.device) -> list[Outcome]:
    """Train every layout in turn on every rank; rank 0 keeps each one's outcome."""
    root = agree_on_root(request.options.outdir)
    outcomes = []
    for i, (layout, argv) in enumerate(zip(request.layouts, request.argvs, strict=True)):
        logger.info("verify: layout %d/%d %r", i + 1, len(request.layouts), layout.text)
        slug = re.sub(r"[^A-Za-z0-9.]+", "_", layout.text).strip("_")
        with layout_training([*argv, "--outdir", str(root / f"{i}-{slug}")], info,
                             device) as trainer:
            trainer.fit()
            params = whole_model(trainer, lambda p: p)
            outdir = trainer.metrics.outdir
        if info.rank == 0:
            outcomes.append(read_outcome(outdir, params))
        del trainer
        gc.collect()
    return outcomes


def report(request: Request, outcomes: list[Outcome], as_json: bool) -> bool:
    """Rank 0: print the table (or JSON) on stdout; True when every layout agrees."""
    o = request.options
    verdicts = [compare(layout.text, out, outcomes[0], o.rtol, o.grad_rtol, o.param_rtol)
                for layout, out in zip(request.layouts[1:], outcomes[1:], strict=True)]
    notes = notes_for(request.base, o)
    if as_json:
        print(json.dumps({"reference": request.layouts[0].text, "notes": notes,
                          "layouts": [asdict(v) for v in verdicts]}))
    else:
        print(format_table(verdicts, request.layouts[0].text, notes))
    return all(v.ok for v in verdicts)


def main(argv: Sequence[str]) -> int:
    """Exit 0 when every layout agrees with the first, 1 when one does not, 2 on bad input.
    Training logs go to stderr, so stdout holds only the result."""
    if list(argv[:1]) in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    watch_launcher()
    info = rank_info()
    try:
        request = parse_request(argv, info.world_size)
        if len(request.layouts) < 2:
            raise ConfigError("--layouts needs at least two layouts (the first is the "
                              "reference)")
        with process_group(info) as (info, device):
            with contextlib.redirect_stdout(sys.stderr), logging_scope(info.rank):
                outcomes = run_layouts(request, info, device)
            agreed = report(request, outcomes, request.options.json) if info.rank == 0 \
                else True
            flag = torch.tensor([float(agreed)], device=device)
            dist.broadcast(flag, src=0)  # every rank exits with rank 0's verdict
            agreed = bool(flag.item())
    except ConfigError as e:
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        write_error_file(f"error: {e}")  # for `loom launch`, as `loom train` leaves it
        return BAD_INPUT_EXIT
    return 0 if agreed else FAILURE_EXIT

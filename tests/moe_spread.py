"""Measures the spread that the multi-rank MoE parity tolerances are derived from.

A layout and its single-process reference add the same numbers in different orders
(sharded matmuls, per-rank batch shapes, gloo's reduction order), and so does one process
under another CPU kernel set (`ATEN_CPU_CAPABILITY`). Both are rounding, not bugs; AdamW
then turns a rounding difference on a near-zero gradient into a full-size step, so the
difference grows step by step. This script trains every multi-rank MoE comparison the
suite makes (tests/parity/test_moe_parity.py, test_simple_fsdp_experts.py,
test_compiled_moe_parity.py, and the slow pp2 x ep2 case of test_pipeline_parity.py) under
the capability it is run with, and reports, per layout and per step, the relative
difference of each compared metric from its reference.

    for cap in default avx2 avx512; do
        ATEN_CPU_CAPABILITY=$cap python -m tests.moe_spread train runs/spread/$cap
    done
    python -m tests.moe_spread report runs/spread/*   # JSON on stdout, table on stderr

`report` also compares the single-process references across the capabilities given: the
spread of one process against itself, which no parallel code can cause.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tests.compare import column
from tests.parity import test_compiled_moe_parity as compiled
from tests.parity import test_moe_parity as moe
from tests.parity import test_pipeline_parity as pipeline
from tests.parity import test_simple_fsdp_experts as simple

KEYS = ("train/loss", "grad/norm_preclip")
PIPELINE = {"single": (1, 1, []), "pp2_ep2": (4, 2, [*pipeline.PP2, "--ep", "2"])}


def train(root: Path) -> None:
    """Every multi-rank MoE comparison of the suite, trained under this process's
    capability into `root/<suite>/<layout>`."""
    moe.train_layouts(root / "moe")
    moe.launch(4, moe.SLOW_LAYOUTS, root / "moe")
    simple.train_layouts(root / "simple")
    single = compiled.train_reference(root / "compiled")
    for case in compiled.CASES:
        compiled.run_case(single, root / "compiled", case)
    for world in (1, 4):
        pipeline.launch(world, PIPELINE, root / "pipeline", pipeline.MOE_FLAGS, options=())


def pairs(root: Path) -> dict[str, tuple[Path, Path]]:
    """Every compared (candidate, reference) pair under `root`, by `suite/layout`."""
    found = {f"moe/{name}": (root / "moe" / name, root / "moe" / moe.reference_of(name))
             for name in {**moe.LAYOUTS, **moe.SLOW_LAYOUTS} if name not in moe.SINGLES}
    found |= {f"simple/{name}": (root / "simple" / name, root / "simple" / "single")
              for name in simple.LAYOUTS}
    found |= {f"compiled/{case}": (root / "compiled" / case, root / "compiled" / "single")
              for case in compiled.CASES}
    found["pipeline/pp2_ep2"] = (root / "pipeline" / "pp2_ep2", root / "pipeline" / "single")
    return found


def per_step(candidate: Path, reference: Path, key: str) -> dict[int, float]:
    """{step: |candidate - reference| / |reference|} of one metric."""
    new, ref = column(candidate, key), column(reference, key)
    return {step: abs(new[step] - ref[step]) / abs(ref[step]) for step in sorted(ref)}


def param_spread(candidate: Path, reference: Path) -> float:
    """The largest per-tensor ||a - e|| / ||e|| of the final parameters."""
    new, ref = torch.load(candidate / "params.pt"), torch.load(reference / "params.pt")
    return max(float((new[n].double() - e.double()).norm() / e.double().norm())
               for n, e in ref.items())


def spread(candidate: Path, reference: Path) -> dict:
    return {**{key: per_step(candidate, reference, key) for key in KEYS},
            "params": param_spread(candidate, reference)}


def report(roots: list[Path]) -> dict:
    """Per capability folder, every pair's spread; across folders, the references'."""
    out: dict = {"layouts": {}, "references": {}}
    for root in roots:
        out["layouts"][root.name] = {name: spread(*pair) for name, pair in pairs(root).items()}
    first = roots[0]
    for root in roots[1:]:
        for suite, ref in (("moe", "single"), ("moe", "few_single"), ("simple", "single"),
                           ("compiled", "single"), ("pipeline", "single")):
            name = f"{root.name} vs {first.name}: {suite}/{ref}"
            out["references"][name] = spread(root / suite / ref, first / suite / ref)
    return out


def table(result: dict) -> str:
    """One line per pair: the largest relative difference of each metric, and at which
    step."""
    lines = [f"{'pair':58} {'loss':>16} {'grad norm':>16} {'params':>9}"]
    rows = [(f"{cap} {name}", s) for cap, layouts in result["layouts"].items()
            for name, s in layouts.items()] + list(result["references"].items())
    for name, s in rows:
        cells = []
        for key in KEYS:
            step = max(s[key], key=s[key].get)
            cells.append(f"{s[key][step]:9.2e} @ {step:>2}")
        lines.append(f"{name:58} {cells[0]:>16} {cells[1]:>16} {s['params']:9.2e}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train").add_argument("root", type=Path)
    sub.add_parser("report").add_argument("roots", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "train":
        train(args.root)
        return
    result = report(args.roots)
    print(table(result), file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

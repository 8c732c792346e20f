"""The composition matrix (loom.config.compose): every pair of parallelism features is refused
by the table validation raises from, exercised by a parity test that exists, or named as
an untested gap that validation accepts; nothing is both, nothing is neither."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import tests.families.gpt2  # noqa: F401  (registers gpt2-test: its layouts are declared too)
from loom.compat import checkpoint_inside_compile_saves_mesh, v_schedules_send_to_own_rank
from loom.config import ConfigError, config_from_flags
from loom.config.compose import (
    FEATURES,
    REFUSALS,
    SAME_FLAG,
    TESTED,
    UNTESTED,
    cell,
    pairs,
    refusal_for,
)
from loom.models.registry import families
from tests.harness import REPO
from tests.parity.family_layouts import FAMILY_LAYOUT_TESTS

validate_module = importlib.import_module("loom.config.validate")  # loom.config.validate
# is also the name of the function the package exports
BASE = {"model": "debug", "n_layers": 4}
"""4 blocks: interleaved pp2 (4 stages) has layers to split."""


def flags_of(a: str, b: str) -> dict[str, object]:
    return {**BASE, **FEATURES[a], **FEATURES[b]}


def collected(files: set[str]) -> set[str]:
    """The node ids pytest collects from `files`, slow ones included."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "",
                          "-p", "no:cacheprovider", *sorted(files)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def test_the_table_covers_every_pair_once() -> None:
    refused = {frozenset(c) for r in REFUSALS for c in r.cells}
    everything = {frozenset(p) for p in pairs()}
    groups = {"same flag": set(SAME_FLAG), "refused": refused, "tested": set(TESTED),
              "untested": set(UNTESTED)}
    for name, group in groups.items():
        assert group <= everything, (name, group - everything)
    for (x, gx), (y, gy) in ((a, b) for a in groups.items() for b in groups.items()
                             if a[0] < b[0]):
        assert not gx & gy, f"in both {x} and {y}: {[sorted(p) for p in gx & gy]}"
    missing = everything - set().union(*groups.values())
    assert not missing, [sorted(p) for p in missing]
    assert len(everything) == 78  # 13 features


@pytest.mark.parametrize(("a", "b"), pairs(), ids=[f"{a}+{b}" for a, b in pairs()])
def test_each_cell_is_what_validation_does(a: str, b: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused cell is refused by its own table entry, with that entry's message; every
    other cell (tested or untested) passes validation."""
    status, _ = cell(a, b)
    if status == "same flag":
        return
    seen = []
    real = validate_module.refuse_combinations
    monkeypatch.setattr(validate_module, "refuse_combinations",
                        lambda cfg: (seen.append(cfg), real(cfg)))
    if status != "refused":
        config_from_flags(flags_of(a, b), environ={})
        assert seen and refusal_for(seen[0]) is None
        return
    with pytest.raises(ConfigError) as raised:
        config_from_flags(flags_of(a, b), environ={})
    assert seen, f"{a} x {b} was refused before the table: {raised.value}"
    refusal = refusal_for(seen[0])
    assert refusal is not None and ((a, b) in refusal.cells or (b, a) in refusal.cells)
    assert str(raised.value) == refusal.message(seen[0])


def test_pp_with_tp_takes_the_vocabulary_parallel_losses() -> None:
    """Refused until #45; pp2 x tp2 parity cases run both."""
    for loss in ("fused-linear", "loss-parallel"):
        cfg = config_from_flags({**BASE, "pp": 2, "tp": 2, "loss_impl": loss}, environ={})
        assert cfg.loss.loss_impl == loss


def test_cp_takes_the_moe_balance_loss() -> None:
    """Refused until #45: the balance loss's per-sequence sums are summed over cp (tests/
    parity/test_moe_parity.py::test_layout_matches_single_process[aux_cp2_ep2])."""
    cfg = config_from_flags({"model": "moe-debug", "cp": 2, "aux_loss_coeff": 0.01},
                            environ={})
    assert cfg.parallel.cp == 2 and cfg.model.values()["aux_loss_coeff"] == 0.01


def test_each_tested_cell_names_a_collected_test() -> None:
    tests = [*TESTED.values(),
             *(t for family in FAMILY_LAYOUT_TESTS.values() for t in family.values())]
    ids = collected({test.split("::")[0] for test in tests})
    missing = sorted(test for test in tests if test not in ids)
    assert not missing, missing


def test_each_family_layout_has_its_parity_test() -> None:
    """A layout a family's spec declares is run by a test the tests name, and each named test
    belongs to a declared layout (the spec holds the layouts, the tests the node ids)."""
    declared = {spec.name: set(spec.layouts) for spec in families() if spec.layouts}
    assert declared == {name: set(tests) for name, tests in FAMILY_LAYOUT_TESTS.items()}


def test_the_refusals_off_the_matrix_still_refuse() -> None:
    """The table's rows that cover no matrix cell (selective AC compiled under SimpleFSDP,
    on the torch versions that fail it; the split-backward schedules with EP) apply."""
    cases = {"needs torch 2.13": {"pp": 2, "pp_schedule": "dualpipev", "batch_size": 4},
             "nested FSDP2 units": {"model": "moe-debug", "pp": 2, "ep": 2,
                                    "pp_schedule": "zero-bubble"},
             "compiled autograd": {"dp_shard": 2, "data_parallel": "simple-fsdp",
                                   "compile": True, "activation_checkpoint": "selective"}}
    # (the same row refuses tp 2 with compile and selective AC: tests/unit/test_knobs.py)
    assert len(cases) == sum(1 for r in REFUSALS if not r.cells)
    if not checkpoint_inside_compile_saves_mesh():  # this torch runs it
        config_from_flags(cases.pop("compiled autograd"), environ={})
    if not v_schedules_send_to_own_rank():
        config_from_flags(cases.pop("needs torch 2.13"), environ={})
    elif "nested FSDP2 units" in cases:  # refused first for the torch version
        cases["needs torch 2.13"] = cases.pop("nested FSDP2 units")
    for text, flags in cases.items():
        with pytest.raises(ConfigError, match=text):
            config_from_flags(flags, environ={})


def test_each_refusal_names_its_reproduction() -> None:
    """A refusal rests on a test that reproduces the failure on the torch it names (and
    fails the day torch changes): every row's reason names such a test file, which exists."""
    for refusal in REFUSALS:
        named = re.findall(r"tests/[\w/]+\.py", refusal.why)
        assert named, f"no reproduction test named: {refusal.why[:100]}"
        missing = [path for path in named if not (REPO / path).is_file()]
        assert not missing, missing

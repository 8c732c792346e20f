"""What parity tests read from a run folder and how they compare it: every failed check
names the worst difference and where it is (step or parameter, element index)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from loom.observability.metrics import read_rows


def rows(folder: Path, rank: int = 0) -> list[dict]:
    """The metric rows one rank wrote into a run folder."""
    return read_rows(folder / f"metrics-{rank}.jsonl")


def column(folder: Path, key: str = "train/loss", rank: int = 0) -> dict[int, float]:
    """{step: value} of one metric logged by one rank (rank 0 by default)."""
    return {r["train/iter"]: r[key] for r in rows(folder, rank) if key in r}


def losses(folder: Path) -> torch.Tensor:
    """Rank 0's per-step losses in step order, as float64 for comparing."""
    return torch.tensor(list(column(folder).values()), dtype=torch.float64)


def worst(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest absolute difference and its index."""
    diff = (actual.double() - expected.double()).abs()
    flat = int(diff.argmax())
    return float(diff.flatten()[flat]), tuple(int(i) for i in torch.unravel_index(
        torch.tensor(flat), diff.shape))


def assert_series_close(actual: Mapping[int, float], expected: Mapping[int, float], *,
                        rtol: float, what: str = "loss") -> None:
    """Per-step values (e.g. losses) agree to `rtol` relative, at the same steps."""
    assert sorted(actual) == sorted(expected), f"{what}: steps {sorted(actual)} vs " \
                                               f"{sorted(expected)}"
    steps = sorted(expected)
    rel = {s: abs(actual[s] - expected[s]) / abs(expected[s]) for s in steps}
    step = max(rel, key=rel.get)
    assert rel[step] <= rtol, (f"{what} differs most at step {step}: {actual[step]!r} vs "
                               f"{expected[step]!r} (relative {rel[step]:.3g} > {rtol:g})")


def assert_tensors_close(actual: Mapping[str, torch.Tensor],
                         expected: Mapping[str, torch.Tensor], *, rtol: float,
                         atol: float, what: str) -> None:
    """Element-wise |a - e| <= atol + rtol * |e| for every tensor; reports the worst
    element of the worst tensor (ratio of its difference to its allowance)."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    ratios = {}
    for name, e in expected.items():
        allowed = atol + rtol * e.double().abs()
        ratios[name] = float(((actual[name].double() - e.double()).abs() / allowed).max())
    name = max(ratios, key=ratios.get)
    diff, index = worst(actual[name], expected[name])
    assert ratios[name] <= 1, (f"{what}: {name}{list(index)} differs by {diff:.3g} "
                               f"(atol {atol:g}, rtol {rtol:g}; {ratios[name]:.3g}x the "
                               "allowance)")


def assert_norms_close(actual: Mapping[str, torch.Tensor],
                       expected: Mapping[str, torch.Tensor], *, rtol: float,
                       what: str) -> None:
    """Per tensor, ||a - e|| <= rtol * ||e||: one element flipped by a reduction order is
    tolerated, a systematic difference across a tensor is not."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    rel = {name: float((actual[name].double() - e.double()).norm() / e.double().norm())
           for name, e in expected.items()}
    name = max(rel, key=rel.get)
    diff, index = worst(actual[name], expected[name])
    assert rel[name] <= rtol, (f"{what}: {name} differs by {rel[name]:.3g} of its norm "
                               f"(> {rtol:g}); worst element {list(index)} by {diff:.3g}")

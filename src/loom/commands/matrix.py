"""docs/parallelism.md's composition matrix, rendered from `loom.config.compose`'s table and
the registered families' specs (their own layouts and refusals):
`python -m loom.commands.matrix --write docs/parallelism.md` regenerates the section between
its markers (tests/unit/test_docs.py fails when it is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

from loom.config.compose import (
    FEATURES,
    REFUSALS,
    TORCH_CHECKED,
    cell,
    pairs,
)
from loom.models.registry import families

BEGIN, END = "<!-- composition-matrix:begin -->", "<!-- composition-matrix:end -->"
_MARK = {"composes": "✓", "refused": "✗", "untested": "?", "same flag": "—"}


def render() -> str:
    """The matrix section of docs/parallelism.md, between its markers."""
    names = list(FEATURES)
    lines = [BEGIN, "", "Generated from `src/loom/config/compose.py` by `python -m "
             "loom.commands.matrix --write docs/parallelism.md`; ✓ composes (the test below "
             "runs it), ✗ refused (why below), ? accepted but no parity test yet, — two "
             "values of one flag.", "",
             "| | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for a in names:
        row = [_MARK[cell(a, b)[0]] if a != b else "" for b in names]
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", f"Each cell (reasons checked on torch {TORCH_CHECKED}):", ""]
    for a, b in pairs():
        status, detail = cell(a, b)
        shown = f"`{detail}`" if status == "composes" else detail
        lines.append(f"- `{a}` × `{b}`: {status}: {shown}")
    others = [r.why for r in REFUSALS if not r.cells]
    lines += ["", "Further refused combinations:", "", *(f"- {why}" for why in others),
              *family_lines(), "", END]
    return "\n".join(lines)


def family_lines() -> list[str]:
    """Each of loom's families with its own modules: the layouts its parity tests run (the
    tests map each to its test: tests/parity/family_layouts.py), its refusals."""
    lines = []
    for spec in families():
        if not spec.model_cls.__module__.startswith("loom."):
            continue  # a family registered from outside loom (a test's) is not loom's docs
        if spec.layouts:
            lines += ["", f"The `{spec.name}` family's layouts, each matching one process:",
                      "", *(f"- {layout}" for layout in spec.layouts)]
        if spec.refusals:
            lines += ["", f"Refused in the `{spec.name}` family:", "",
                      *(f"- {why}" for why in spec.refusals)]
    return lines


def with_matrix(text: str) -> str:
    """`text` with its matrix section replaced by the generated one."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render() + text[end:]


def main(argv: list[str]) -> None:
    """`--write PAGE`: regenerate PAGE's matrix section in place; else print it."""
    if argv[:1] == ["--write"]:
        page = Path(argv[1])
        page.write_text(with_matrix(page.read_text()))
    else:
        print(render())


if __name__ == "__main__":
    main(sys.argv[1:])

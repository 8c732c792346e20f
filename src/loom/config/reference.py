"""The flag reference, `docs/flags.md`, generated from the schema and the registered
families' flags: `python -m loom.commands.reference > docs/flags.md` (that module registers
loom's families first; `loom.config` cannot import them, they import it).

Every flag is a documented field of `loom.config.schema` or of a family's flags, so the
reference is rendered from
those declarations (help text, default, choices, aliases, environment variable, TOML table)
instead of being written by hand; a test regenerates it and fails when the file is stale.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from loom.config.families import flag_groups, group_title
from loom.config.job import SECTIONS
from loom.config.parser import HELP_GROUPS
from loom.config.plan_flags import PlanFlags
from loom.config.uses import use_table

HEADER = """# Flag reference

Generated from `src/loom/config/schema.py` and each family's flags (`src/loom/models/*/flags.py`)
by `python -m loom.commands.reference > docs/flags.md`;
do not edit by hand (`tests/unit/test_docs.py` fails when this file is stale).
Every flag of `loom train` is also taken by `loom plan`, `loom eval` and in a `--config` TOML
file, under the table named in each heading, with the name in snake case. Precedence:
defaults < preset < environment < file < flags.
"""

PARSER_ONLY = (
    ("--fp32", "same as `--dtype fp32`"),
    ("--no-reshard-after-forward", "same as `--reshard-after-forward never`"),
    ("--config FILE", "TOML file of settings, one `[table]` per group below; flags override it"),
    ("--print-config", "print the effective config as TOML and exit"),
)
"""Flags the parser adds beyond the schema's fields (`loom.config.parser.build_parser`)."""


def cell(text: str) -> str:
    """Markdown table cell: pipes escaped, so `a|b` choices do not split the row."""
    return text.replace("|", "\\|")


def default_text(field: dataclasses.Field) -> str:
    default: Any = field.default
    if default is None or default == ():
        return "-"
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def flag_text(field: dataclasses.Field) -> str:
    names = [f"--{field.name.replace('_', '-')}", *field.metadata["aliases"]]
    if field.default is True:  # argparse's BooleanOptionalAction
        names.append(f"--no-{field.name.replace('_', '-')}")
    choices = field.metadata["choices"]
    value = f" {{{','.join(choices)}}}" if choices else ""
    return ", ".join(f"`{name}{value}`" for name in names)


def notes(field: dataclasses.Field) -> str:
    meta = field.metadata
    extra = [f"env `${meta['env']}`"] if meta["env"] else []
    if meta["repeat"]:
        extra.append("repeatable")
    if meta["hidden"]:
        extra.append("not in `--help`")
    return "; ".join(extra)


def rows(flags: list[dataclasses.Field]) -> list[str]:
    return [f"| {flag_text(field)} | {cell(default_text(field))} | "
            f"{cell(field.metadata['help'])} | {notes(field)} |" for field in flags]


TABLE = ["| flag | default | what it does | notes |", "| --- | --- | --- | --- |"]


def section(name: str, title: str) -> list[str]:
    own = [f for f in dataclasses.fields(SECTIONS[name]) if "help" in f.metadata]
    return [f"## {title} (`[{name}]`)", "", *TABLE, *rows(own), ""]


def family_sections() -> list[str]:
    """loom's own families' flags, one table per family group, also under `[model]`; a
    family registered from outside loom (a test's, a user's) shows in `loom train --help`
    once its module is imported, not here."""
    lines = []
    for group in flag_groups():
        if group.__module__.startswith("loom."):
            lines += [f"### model: {group_title(group)} (`[model]`; `{group.__module__}`)",
                      "", *TABLE, *rows(list(dataclasses.fields(group))), ""]
    return lines


USE_NOTE = """## Which family uses which model flag

Each family declares the model flags it uses (`ModelSpec.uses`, in the family's folder); a
model flag its family does not use is refused in one line (exit 2) before anything is
written, so no flag is accepted and ignored. `--model`, `--family`, `--model-impl` and
`--trust-remote-code` pick the model and are every family's; the flags of every other
table act the same on every family. `transformers` is transformers' own module of a
Hugging Face folder, whose shape is the folder's. A Hugging Face folder imported natively
takes the flags of the family that serves it. `tests/unit/models/test_flag_use.py` walks
this table: each *used* flag changes the built model or its first step, each *refused*
one exits 2 naming the flag and the family.
"""


def render() -> str:
    """The whole reference, in `loom train --help`'s group order."""
    lines = [HEADER]
    for name, title in HELP_GROUPS.items():
        lines += section(name, title)
        lines += family_sections() if name == "model" else []
    lines += ["## loom plan", "", "`loom plan` takes every flag above and its own "
              "(`src/loom/config/plan_flags.py`; docs/planning.md):", "", *TABLE,
              *rows(list(dataclasses.fields(PlanFlags))), ""]
    lines += [USE_NOTE, *use_table(), ""]
    lines += ["## Parser shortcuts", "", "| flag | what it does |", "| --- | --- |"]
    lines += [f"| `{name}` | {cell(text)} |" for name, text in PARSER_ONLY]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # without the families their flags would be missing: say so
    sys.exit("error: run python -m loom.commands.reference > docs/flags.md (it registers "
             "loom's families, whose flags the reference lists)")

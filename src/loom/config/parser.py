"""`loom train`'s flags: one argparse parser generated from the schema, in help groups."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import Field, fields
from typing import Any

from loom.config.families import flag_groups, group_title
from loom.config.file import read_config_file
from loom.config.job import SECTIONS, JobConfig, section_fields
from loom.config.presets import PRESETS
from loom.config.sources import config_from_flags
from loom.errors import ConfigError


def _flag_names(name: str, aliases: Sequence[str]) -> list[str]:
    names = [f"--{name.replace('_', '-')}"]
    if "_" in name:
        names.append(f"--{name}")
    return names + list(aliases)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so every rank fails with one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


HELP_GROUPS = {"model": "model", "parallel": "parallel", "optim": "optimisation",
               "lora": "LoRA", "train": "training", "checkpoint": "checkpoint", "loss": "loss",
               "data": "data", "eval": "validation", "output": "output"}
"""`loom train --help` groups, in the order of the README's flag table; every section of
`JobConfig` must be listed (a test checks it), or its flags would not exist."""


def _help(text: str, default: Any) -> str:
    """The flag's help with its default (argparse cannot show it: defaults are suppressed)."""
    if default is None or default is False:
        return text
    return f"{text} [default: {'on' if default is True else default}]"


def _presets_epilog() -> str:
    shapes = [f"{name} ({p['dim']}x{p['n_layers']}{', MoE' if p.get('n_experts') else ''})"
              for name, p in PRESETS.items()]
    return ("model presets (--model NAME; dim x layers): " + ", ".join(shapes)
            + "; a Hugging Face repo id or local folder also works")


def add_flags(group: Any, flags: list[Field]) -> None:
    """One argparse option per declared flag, its kind from the declaration."""
    for f in flags:
        meta = f.metadata
        kwargs: dict[str, Any] = dict(dest=f.name, help=_help(meta["help"], f.default))
        if meta["hidden"]:
            kwargs["help"] = argparse.SUPPRESS
        if meta["repeat"]:
            kwargs.update(action="append", type=meta["type"])
        elif isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kwargs["type"] = meta["type"] or type(f.default)
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if meta["const"] is not None:
                kwargs.update(nargs="?", const=meta["const"])
        group.add_argument(*_flag_names(f.name, meta["aliases"]), **kwargs)


def build_parser(prog: str = "loom train") -> argparse.ArgumentParser:
    """One argparse parser generated from the dataclass declarations (defaults suppressed,
    so the parsed namespace holds exactly the flags the user gave)."""
    parser = _Parser(prog=prog, usage="%(prog)s [FLAGS]", argument_default=argparse.SUPPRESS,
                     epilog=_presets_epilog())
    for section, title in HELP_GROUPS.items():
        add_flags(parser.add_argument_group(title),
                   [f for f in fields(SECTIONS[section]) if "help" in f.metadata])
        if section == "model":  # each family's own flags, in a group of their own
            for family in flag_groups():
                add_flags(parser.add_argument_group(f"model: {group_title(family)}"),
                           list(fields(family)))
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                        action="store_const", const="never",
                        help="same as --reshard-after-forward never")
    parser.add_argument("--fp32", dest="dtype", action="store_const", const="fp32",
                        help="same as --dtype fp32")
    parser.add_argument("--config", dest="config_file", type=str,
                        help="TOML file of settings, one [section] per group; flags override it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective config as TOML and exit")
    return parser


def parse_args(argv: Sequence[str]) -> JobConfig:
    """Parse `loom train` flags (and a --config file); errors become ConfigError (one line,
    exit 2). --print-config is acted on by the caller."""
    explicit = vars(build_parser().parse_args(list(argv)))
    explicit.pop("print_config", None)
    path = explicit.pop("config_file", None)
    tables = {name: section_fields(name) for name in SECTIONS}
    return config_from_flags(explicit, from_file=read_config_file(path, tables) if path else None)

"""`loom train --help` shows groups, defaults and presets; `loom --version`; a fixed default
seed; every command that trains in the README and docs/ stops by itself."""

from __future__ import annotations

import re

import pytest

from loom import __version__
from loom.cli import main
from loom.config import HELP_GROUPS, SECTIONS, build_parser, parse_args
from loom.config.presets import PRESETS
from tests.harness import REPO


def test_help_groups_flags_like_the_readme_and_shows_defaults_and_presets():
    text = build_parser().format_help()
    positions = [text.index(f"\n{title}:\n") for title in HELP_GROUPS.values()]
    assert positions == sorted(positions)
    for shown in ("--lr LR", "[default: 0.003]", "[default: 5]", "--seed SEED",
                  "[default: 0]", "--batch-size BATCH_SIZE"):
        assert shown in text, shown
    lr_help = text[text.index("--lr LR"):text.index("--max-grad-norm")]
    assert "[default: 0.003]" in lr_help
    # the epilog is wrapped to the terminal width, at spaces and at a name's hyphens
    packed = "".join(text.split())
    assert all(f"{name}(" in packed for name in PRESETS)


def test_every_config_section_has_its_flags_in_help():
    assert set(HELP_GROUPS) == set(SECTIONS)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"loom {__version__} (torch ")


def test_default_seed_is_fixed():
    assert parse_args([]).train.seed == parse_args(["--model", "debug"]).train.seed == 0


def test_every_readme_command_that_trains_has_max_steps():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [block for page in pages
              for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)]
    commands = [line for block in blocks for line in block.splitlines()
                if "loom train" in line and "--help" not in line]
    assert len(commands) >= 8
    missing = [c for c in commands if "--max-steps" not in c]
    assert not missing, missing

"""Docs that cannot rot: every `loom ...` command in the README and docs/ is run in a cheap
form, every relative link resolves, and docs/flags.md matches the schema it is generated
from (and docs/parallelism.md's composition matrix the refusal table, loom.commands.matrix). A
renamed flag, subcommand, page or heading fails here, not for a user.

The cheap form of each command, by subcommand:
- `loom train ARGS`: parsed and validated as `loom train` does before any work (flags,
  presets, environment, a --config file, the config's own checks), then its mesh is checked
  against the world size of the enclosing `loom launch -n N --nnodes M` (1 when run alone;
  skipped under a launch without -n, whose size a scheduler decides). Training itself is
  run once, in `test_the_readme_first_command_trains`, as `--max-steps 1 --dataset random`.
- `loom launch OPTS CMD`: run for real with `--dry-run` (the command it would start), outside
  any Slurm/PBS job, then CMD in its own cheap form.
- `loom plan ARGS`: run for real when the model is `debug` (seconds) or with `--failures`
  (arithmetic); otherwise its flags are parsed and the train flags validated against
  `--world-size`, as `loom plan` does before tracing.
- `loom export|generate|tokenize ARGS`: parsed by the command's own parser (the parse result
  is intercepted before the command would read a checkpoint or a corpus).
- `loom eval CKPT ARGS`: ARGS parsed and validated as training flags, as `loom eval` does.
- `loom doctor`, `loom --version`, `loom X --help`: run for real (doctor with a stand-in
  matmul benchmark, so that it does not time the CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from unittest import mock

import pytest

from loom.cli import COMMANDS
from loom.cli import main as loom_main
from loom.commands import matrix
from loom.config import build_parser, parse_args
from loom.config.families import flag_groups
from loom.config.plan_flags import parse_plan_flags
from loom.config.reference import render
from loom.observability import flops
from loom.parallel.mesh import ParallelDims
from loom.plan import command as plan_command
from loom.runtime import launch as launch_command
from loom.runtime.launch_ft import GROUP_ENV, LIGHTHOUSE_ENV
from tests.harness import REPO, run_process

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCHEDULERS = ("SLURM_JOB_ID", "PBS_JOBID")
IDLE = flops.PeakMeasurement(3e11, 1.0, 2, clean=True)


def bash_blocks(text: str) -> Iterator[str]:
    yield from re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def loom_commands(block: str) -> Iterator[list[str]]:
    """Each `loom ...` command of a bash block as argv: continuation lines joined, comments,
    redirections and a trailing `&` dropped, `;` and `&&` separating commands."""
    script = block.replace("\\\n", " ")
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in (";", "&&", "&"):
                if command[:1] == ["loom"]:
                    yield command[1:]
                command = []
            elif token.startswith(">") or (command and command[-1] == ">"):
                command.append(">")
            else:
                command.append(token)


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(page.relative_to(REPO).as_posix(), [t for t in argv if t != ">"])
            for page in PAGES for block in bash_blocks(page.read_text())
            for argv in loom_commands(block)]


COMMANDS_FOUND = documented_commands()


class Parsed(Exception):
    """Raised in place of running a command once its parser accepted the arguments."""


def check_train(argv: list[str], world: int | None, tmp_path: Path) -> None:
    argv = list(argv)
    if "--config" in argv:  # the page's own file does not exist here: an empty one parses
        i = argv.index("--config") + 1
        if not Path(argv[i]).exists():
            (tmp_path / "run.toml").write_text("")
            argv[i] = str(tmp_path / "run.toml")
    cfg = parse_args(argv)
    if world is not None:
        ParallelDims.from_config(cfg.parallel, world)


def check_launch(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    opts = launch_command.parse_args(argv)
    assert launch_command.main(["--dry-run", *argv]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip(), "the dry run printed no command"
    assert opts.cmd[:2] == ["loom", "train"], opts.cmd
    world = opts.nproc * (opts.nnodes or 1) // opts.ft_replica_groups if opts.nproc else None
    given = {GROUP_ENV: "0", LIGHTHOUSE_ENV: "http://localhost:1"}  # what a group is handed
    with mock.patch.dict(os.environ, given if opts.ft_replica_groups > 1 else {}):
        check_train(opts.cmd[2:], world, tmp_path)


def check_plan(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    if "--failures" in argv:
        assert plan_command.main(argv) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        if "--json" in argv:
            json.loads(out)
        return
    options, train_argv = parse_plan_flags(argv)
    cfg = parse_args(train_argv)
    if cfg.model.model != "debug":
        plan_command.check_supported(cfg)
        ParallelDims.from_config(cfg.parallel, options.world_size)
        return
    assert plan_command.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if options.json:
        json.loads(out)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_:
        loom_main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    return out


@pytest.fixture
def quiet_loom(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No scheduler, a fresh cache, a stand-in matmul benchmark, and the loom logger's
    handlers restored (commands add one bound to the captured streams)."""
    for name in SCHEDULERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype: IDLE)
    monkeypatch.chdir(tmp_path)
    logger = logging.getLogger("loom")
    before, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = before, level


def test_the_pages_hold_enough_commands_to_test():
    """Guards the extraction itself: a broken regex would make the test below vacuous."""
    kinds = {argv[0] for _, argv in COMMANDS_FOUND}
    assert len(COMMANDS_FOUND) >= 40, COMMANDS_FOUND
    assert {"train", "launch", "plan", "export", "doctor"} <= kinds, kinds


@pytest.mark.parametrize(("page", "argv"), COMMANDS_FOUND,
                         ids=[f"{page}:{' '.join(argv)[:60]}" for page, argv in COMMANDS_FOUND])
def test_documented_command_runs_in_its_cheap_form(page, argv, tmp_path, capsys, quiet_loom,
                                                   parse_only_when):
    command, rest = argv[0], argv[1:]
    if command in ("--version", "-V") or "--help" in rest or "-h" in rest:
        run_cli(argv, capsys)
    elif command == "train":
        check_train(rest, 1, tmp_path)
    elif command == "launch":
        check_launch(rest, tmp_path, capsys)
    elif command == "plan":
        check_plan(rest, capsys)
    elif command == "doctor":
        out = run_cli(argv, capsys)
        if "--json" in rest:
            json.loads(out)
    elif command == "eval":
        check_train(rest[1:], 1, tmp_path)
    elif command in ("export", "generate", "tokenize", "digest"):
        parse_only_when()
        with pytest.raises(Parsed):
            loom_main(argv)
    else:
        pytest.fail(f"{page}: unknown command `loom {command}` (known: train, "
                    f"{', '.join(COMMANDS)})")


@pytest.fixture
def parse_only_when(monkeypatch: pytest.MonkeyPatch):
    """Turns parse-only mode on for the commands whose parser is built inside main()."""
    real = argparse.ArgumentParser.parse_args

    def enable() -> None:
        def parse_and_stop(self: argparse.ArgumentParser, *args: object,
                           **kwargs: object) -> None:
            raise Parsed(real(self, *args, **kwargs))

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)

    return enable


def test_a_renamed_flag_is_caught(tmp_path):
    """The checks above would fail on a flag the parser does not know."""
    with pytest.raises(ValueError, match="unrecognized"):
        check_train(["--model", "debug", "--tensor-parallel", "2"], 1, tmp_path)


def test_the_readme_first_command_trains(tmp_path):
    """The tour's first command really trains: one step on random tokens."""
    readme = (REPO / "README.md").read_text()
    first = next(argv for block in bash_blocks(readme.split("## A ten-line tour")[1])
                 for argv in loom_commands(block))
    assert first[:1] == ["train"], first
    argv = [*first, "--max-steps", "1", "--dataset", "random", "--outdir", str(tmp_path / "run")]
    env_run = run_process([sys.executable, "-m", "loom", *argv], timeout=900, cwd=tmp_path)
    assert env_run.returncode == 0, env_run.stdout[-2000:] + env_run.stderr[-2000:]
    rows = (tmp_path / "run" / "metrics-0.jsonl").read_text().splitlines()
    assert [json.loads(row)["train/iter"] for row in rows] == [1]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {github_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def relative_links() -> list[tuple[Path, str]]:
    found = []
    for page in [*PAGES, REPO / ".github" / "ISSUE_TEMPLATE" / "bug_report.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                found.append((page, target))
    return found


def test_every_relative_link_resolves():
    links = relative_links()
    assert len(links) >= 30, links
    broken = []
    for page, target in links:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_flag_reference_is_current():
    stale = (REPO / "docs" / "flags.md").read_text() != render()
    assert not stale, "docs/flags.md is stale: python -m loom.commands.reference > docs/flags.md"


def test_composition_matrix_is_current():
    page = (REPO / "docs" / "parallelism.md").read_text()
    stale = matrix.with_matrix(page) != page
    assert not stale, ("docs/parallelism.md's composition matrix is stale: python -m "
                       "loom.commands.matrix --write docs/parallelism.md")


def test_flag_reference_names_every_flag():
    """Every loom flag; a family registered from outside loom (the tests' GPT-2, once an
    earlier test imported it) has its flags in `--help`, not in loom's reference."""
    text = (REPO / "docs" / "flags.md").read_text()
    outside = {"--" + f.name.replace("_", "-") for g in flag_groups()
               if not g.__module__.startswith("loom.") for f in fields(g)}
    options = {o for action in build_parser()._actions for o in action.option_strings
               if o.startswith("--") and "_" not in o and o != "--help"} - outside
    missing = sorted(o for o in options if f"`{o}" not in text)
    assert not missing, missing

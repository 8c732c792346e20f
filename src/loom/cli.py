"""The `loom` command: `loom train ...` and `loom launch ...`."""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable, Sequence
from importlib.metadata import version

import loom
import loom.families  # registers loom's families: their flags parse
from loom.config import SECTIONS, JobConfig, parse_args
from loom.config.file import to_toml
from loom.config.job import section_values
from loom.errors import (
    BAD_INPUT_EXIT,
    DIVERGED_EXIT,
    FAILURE_EXIT,
    SIGINT_EXIT,
    CheckpointWriteError,
    ConfigError,
    DeviceOutOfMemory,
    NonFiniteLossError,
    Preempted,
)
from loom.runtime.distributed import rank_info
from loom.runtime.logs import quiet_upstream_notices
from loom.runtime.watchdog import report, watch_launcher, write_error_file

USAGE = """usage: loom COMMAND [FLAGS]  |  loom --version

  loom train [FLAGS]          train in this process group (see `loom train --help`)
  loom launch [-n N] CMD...   start CMD on every rank (elastic agent, srun or mpiexec)
  loom export CKPT OUTDIR     write a checkpoint as a Hugging Face Llama model
  loom plan [FLAGS] --world-size N --device-memory SIZE [--search] [--json]
                              predict per-rank peak memory and step time before launch
  loom plan --failures --world-size N   goodput under failures, restart vs replica groups
  loom tokenize SRC OUT       tokenize a corpus into memory-mapped shards (--dataset OUT)
  loom eval CKPT --dataset D  validation loss of a checkpoint
  loom generate CKPT --prompt TEXT   sample text from a checkpoint or HF folder
  loom doctor [--json]        what this machine offers loom (paste it into bug reports)
  loom verify --layouts "dp4" "dp2 tp2" ... [--steps N] [FLAGS]
                              train each layout from the same seed and data; compare
  loom digest CKPT            a checkpoint's SHA-256 digest, to publish and compare
"""


COMMANDS = ("launch", "export", "plan", "tokenize", "eval", "generate", "doctor", "verify",
            "digest")
"""Subcommands other than train, each a module with `main(argv) -> exit code`."""


def subcommand(command: str) -> Callable[[Sequence[str]], int]:
    """The `main` of one of COMMANDS. Imported here, when that command runs: each pulls in
    what only it needs (the launcher none of the model code, export the Hugging Face side),
    and `loom --version` none of it. Plain imports, so the cycle test sees them."""
    if command == "launch":
        from loom.runtime.launch import main
    elif command == "export":
        from loom.hf.export import main
    elif command == "plan":
        from loom.plan.command import main
    elif command == "tokenize":
        from loom.commands.tokenize import main
    elif command == "eval":
        from loom.commands.eval import main
    elif command == "generate":
        from loom.commands.generate import main
    elif command == "doctor":
        from loom.commands.doctor import main
    elif command == "verify":
        from loom.commands.verify import main
    else:
        from loom.checkpoint.digest import main
    return main


def is_comm_failure(err: Exception) -> bool:
    """A collective that failed because a peer died or timed out (gloo, nccl, the store)."""
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or "gloo" in str(err).lower()


def first_sentence(err: Exception) -> str:
    """'Connection reset by peer' out of gloo's '[file.cc:537] ... peer. This is typically...'."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(err).strip())
    first = text.splitlines()[0] if text else ""
    return (first.split(". ")[0] or type(err).__name__)[:300]


def config_toml(cfg: JobConfig) -> str:
    return to_toml({name: section_values(cfg, name) for name in SECTIONS})


def run_train(argv: Sequence[str]) -> int:
    """`loom.fit` with exit codes. Configuration errors are the same on every rank: rank 0
    prints the line, all exit 2 (each rank also leaves the line for `loom launch`, in case
    rank 0 was stopped first). Anything else is rank-specific and printed by the rank that
    hit it."""
    watch_launcher()
    info = rank_info()
    rank = info.rank
    try:
        cfg = parse_args(argv)
        if "--print-config" in argv:
            if rank == 0:
                print(config_toml(cfg), end="")
            return 0
        if not cfg.output.verbose:  # this process's own: its loggers are born quiet
            quiet_upstream_notices()
        from loom.trainer.entry import fit  # the trainer loads once the flags are good

        fit(cfg)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        write_error_file(f"error: {e}")
        return BAD_INPUT_EXIT
    except NonFiniteLossError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return DIVERGED_EXIT
    except Preempted as e:
        if rank == 0:
            print(f"loom: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if rank == 0:
            print("loom: interrupted by Ctrl-C", file=sys.stderr, flush=True)
        return SIGINT_EXIT
    except DeviceOutOfMemory as e:  # rank-specific: the rank that ran out says so
        report(f"error (rank {rank}): {e}")
        return FAILURE_EXIT
    except CheckpointWriteError as e:  # raised on every rank alike
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        write_error_file(f"error: {e}")
        return FAILURE_EXIT
    except Exception as e:
        if is_comm_failure(e):  # the peer that caused it reports the cause
            report(f"error (rank {rank}): lost contact with another rank: {first_sentence(e)}")
            return FAILURE_EXIT
        traceback.print_exc()
        report(f"error (rank {rank}): {type(e).__name__}: {e}")
        return FAILURE_EXIT
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        print(f"loom {loom.__version__} (torch {version('torch')})")
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    if command != "train" and "--verbose" not in rest:  # train decides from its config
        quiet_upstream_notices()
    if command == "train":
        sys.exit(run_train(rest))
    if command in COMMANDS:
        sys.exit(subcommand(command)(rest))
    print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    sys.exit(2)

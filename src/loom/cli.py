"""The `loom` command: `loom train ...` and `loom launch ...`."""

from __future__ import annotations

import importlib
import logging
import signal
import sys
import traceback
import warnings
from collections.abc import Sequence

from loom.config import SECTIONS, ConfigError, JobConfig, parse_args
from loom.config_file import to_toml
from loom.launch import CONFIG_ERROR_EXIT
from loom.mesh import ParallelDims
from loom.runtime import Preempted, rank_info

USAGE = """usage: loom {train,launch,export,tokenize,eval,generate} [FLAGS]

  loom train [FLAGS]          train in this process group (see `loom train --help`)
  loom launch [-n N] CMD...   start CMD on every rank (elastic agent, srun or mpiexec)
  loom export CKPT OUTDIR     write a checkpoint as a Hugging Face Llama model
  loom tokenize SRC OUT       tokenize a corpus into memory-mapped shards (--dataset OUT)
  loom eval CKPT --dataset D  validation loss of a checkpoint
  loom generate CKPT --prompt TEXT   sample text from a checkpoint or HF folder
"""


def setup_logging(rank: int) -> None:
    """Rank 0 logs progress to stdout; other ranks only report errors."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("loom")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    quiet_known_upstream_noise()


def quiet_known_upstream_noise() -> None:
    """Silence torch messages that fire every step yet need no action from the user."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=r"Slicing a flattened dim from root mesh")


def config_toml(cfg: JobConfig) -> str:
    return to_toml({name: getattr(cfg, name) for name in SECTIONS})


def run_train(argv: Sequence[str]) -> int:
    """Configuration errors are the same on every rank: rank 0 prints the line, all exit 2.
    Anything else is rank-specific and printed by the rank that hit it."""
    info = rank_info()
    rank = info.rank
    setup_logging(rank)
    try:
        cfg = parse_args(argv)
        if "--print-config" in argv:
            if rank == 0:
                print(config_toml(cfg), end="")
            return 0
        ParallelDims.from_config(cfg.parallel, info.world_size)  # fails before heavy imports
        from loom import train

        train.main(cfg, info)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    except Preempted as e:
        if rank == 0:
            print(f"loom: {e}", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        traceback.print_exc()
        print(f"error (rank {rank}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "train":
        sys.exit(run_train(rest))
    if command == "launch":
        from loom import launch

        sys.exit(launch.main(rest))
    if command == "export":
        from loom import export

        sys.exit(export.main(rest))
    if command in ("tokenize", "eval", "generate"):
        module = importlib.import_module(f"loom.{ {'eval': 'evaluate'}.get(command, command)}")
        sys.exit(module.main(rest))
    print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    sys.exit(2)

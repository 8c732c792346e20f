"""`loom export`: a checkpoint's model as a Hugging Face folder transformers loads.

A native family's run goes to the architecture its adapter names (Llama, Qwen3, or
Qwen3-MoE where the MoE has that shape; otherwise one line names the feature with no
Hugging Face equivalent); a transformers-path run to its own architecture. Tensors are read
from the checkpoint and written one at a time (safetensors, sharded with an index above
5 GB), into a staging folder renamed into place only after the export checked itself:
transformers loads it, without remote code, and its logits on a fixed batch match loom's.

The pieces: `run_checkpoint` reads the checkpoint, `export_plan` says what is written per
family, `export_files` writes the safetensors and stages the folder, `export_check`
compares logits; this module adds the configs and the tokenizer and is the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loom.config import ConfigError
from loom.data.hub import looks_like_hub_id
from loom.data.tokenizers import (
    SHIPPED_FLAG,
    TextTokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_name,
)
from loom.errors import SIGINT_EXIT
from loom.hf.export_check import check_peft, verify_export
from loom.hf.export_files import DTYPES, MAX_SHARD_BYTES, write_weights
from loom.hf.export_plan import export_plan
from loom.hf.peft import CONFIG_FILE, WEIGHTS_FILE
from loom.hf.run_checkpoint import run_config, run_model, run_reader, run_tokenizer
from loom.runtime.logs import logging_scope
from loom.runtime.outputs import (
    absolute_target,
    check_not_mount,
    check_replaceable,
    output_folder,
)
from loom.runtime.rundir import is_run_folder
from loom.runtime.staging import staged, tidy
from loom.safe_io import write_text_atomic

logger = logging.getLogger("loom")

def generation_config(tokenizer: TextTokenizer | None) -> dict[str, Any]:
    eos = None if tokenizer is None else tokenizer.eot_id
    return {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False,
            "transformers_version": "loom"}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`error: loom export: ...`), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message}\n")


def export_folder(checkpoint: Path, outdir: Path, overwrite: bool,
                  flag: str = "export folder") -> Path:
    """The checked folder an export of `checkpoint` replaces, before anything is read:
    never the checkpoint, its run folder or the local model the run trained from (a LoRA
    run's base), nor a folder inside them but the run's own `hf/`, nor another run, nor
    (with `overwrite`) a folder loom did not export, nor a mount point. An earlier export
    killed mid-swap is recovered first (`loom.runtime.staging`)."""
    if str(outdir):
        tidy(absolute_target(outdir), flag)
    checkpoint = checkpoint.resolve()
    keep, inside = [checkpoint], [checkpoint]
    if checkpoint.parent.name == "checkpoints":
        keep.append(checkpoint.parent.parent)
        inside.append(checkpoint.parent)
    source = run_config(checkpoint).get("model", {}).get("model")
    if source is not None and Path(source).expanduser().is_dir():
        keep.append(Path(source).expanduser())
        inside.append(Path(source).expanduser())
    target = output_folder(outdir, flag, overwrite=overwrite, keep=keep, inside=inside)
    if is_run_folder(target) or (target / "checkpoints").exists():
        raise ConfigError(f"{flag} {outdir} holds a loom run; an export never replaces one: "
                          "choose another folder")
    check_replaceable(target, flag, str(outdir))
    check_not_mount(target, flag, str(outdir))
    return target


def export_peft(checkpoint: Path, outdir: Path, dtype: str, verify: bool,
                overwrite: bool = False) -> str:
    """Write a LoRA run's adapters as a PEFT folder (`loom.hf.peft`), checked by peft."""
    outdir = export_folder(checkpoint, outdir, overwrite)
    with staged(outdir, overwrite, "export folder") as staging:
        held = run_model(checkpoint)
        if held.lora is None:
            raise ConfigError(f"--peft needs a LoRA run's checkpoint; {checkpoint} trained "
                              "every weight (export the model without --peft)")
        config, tensors, shapes = export_plan(held, dtype, peft=True)
        write_weights(staging, tensors, run_reader(held, shapes), shapes, DTYPES[dtype],
                      sys.maxsize, single=WEIGHTS_FILE)
        write_text_atomic(staging / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        checked = ""
        if verify:
            diff = check_peft(staging, checkpoint, config["base_model_name_or_path"], dtype)
            checked = f"; checked: peft's logits match loom's (max diff {diff:.1e})"
    return (f"PEFT LoRA adapter, rank {held.lora.rank}, {len(config['target_modules'])} "
            f"modules, base {config['base_model_name_or_path']}{checked}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a folder makes it a tokenizer folder (AutoTokenizer reads them)."""


def findable(name: str | None) -> bool:
    """The tokenizer can be looked for: the shipped one, a hub id, or a local folder holding
    tokenizer files (a weights-only Hugging Face folder holds none)."""
    if name is None:
        return True
    path = Path(name).expanduser()
    if path.is_dir():
        return any((path / file).is_file() for file in TOKENIZER_FILES)
    return looks_like_hub_id(name, bare_ok=True)


def export_tokenizer(checkpoint: Path, given: str | None, trust_remote_code: bool
                     ) -> tuple[str | None, TextTokenizer | None]:
    """(name, tokenizer) to ship: `given` (--tokenizer-name; a failure to load it is an
    error), else the run's own; a run's tokenizer that cannot be found (the weights-only
    folder it trained from) is (name, None) with one warning: the export ships none."""
    name = tokenizer_name(given, None) if given is not None else run_tokenizer(checkpoint)
    if given is None and not findable(name):
        logger.warning("warning: the run's tokenizer %s cannot be found (no tokenizer files "
                       "there); exporting weights and config only (pass --tokenizer-name to "
                       "ship one)", name)
        return name, None
    return name, load_tokenizer(name, trust_remote_code)


def export(checkpoint: Path, outdir: Path, dtype: str = "fp32",
           trust_remote_code: bool = False, verify: bool = True,
           max_shard_bytes: int = MAX_SHARD_BYTES, tokenizer: str | None = None,
           overwrite: bool = False, flag: str = "export folder") -> str:
    """Write the model, its config and generation config, and the tokenizer (`tokenizer`,
    else the run's) when one is found and the embedding covers it, into `outdir` (checked
    first; replaced whole with `overwrite`); returns what was written, for the one line
    `loom export` prints."""
    outdir = export_folder(checkpoint, outdir, overwrite, flag)
    with staged(outdir, overwrite, flag) as staging:  # one writer from here to the swap
        held = run_model(checkpoint)
        config, tensors, shapes = export_plan(held, dtype)
        tokenizer_id, text_tokenizer = export_tokenizer(checkpoint, tokenizer,
                                                        trust_remote_code)
        vocab = config.get("vocab_size", 0)
        n_files = write_weights(staging, tensors, run_reader(held, shapes), shapes,
                                DTYPES[dtype], max_shard_bytes)
        write_text_atomic(staging / "config.json", json.dumps(config, indent=2) + "\n")
        covered = text_tokenizer is not None and text_tokenizer.size <= vocab
        write_text_atomic(staging / "generation_config.json", json.dumps(
            generation_config(text_tokenizer if covered else None), indent=2) + "\n")
        if covered:
            save_tokenizer(tokenizer_id, staging, trust_remote_code)
        checked = ""
        if verify:
            diff = verify_export(staging, checkpoint, dtype)
            checked = f"; checked: transformers' logits match loom's (max diff {diff:.1e})"
    shown = tokenizer_id or SHIPPED_FLAG
    what = (f"model and tokenizer {shown}" if covered else
            f"model only: tokenizer {shown} not found" if text_tokenizer is None else
            f"model only: its {vocab}-row embedding is smaller than tokenizer "
            f"{shown} ({text_tokenizer.size} tokens)")
    return f"{config['architectures'][0]}, {n_files} safetensors file(s), {what}{checked}"


def main(argv: Sequence[str]) -> int:
    parser = OneLineParser(prog="loom export",
                           description="write a checkpoint as a Hugging Face model")
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder")
    parser.add_argument("outdir", type=Path, help="folder for the Hugging Face model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="split the weights into files of at most this size (with an "
                        "index)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip loading the export with transformers to compare logits")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter folder for the "
                        "run's base model (default: the merged model)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty OUTDIR whole (an earlier export): the new "
                        "export is written beside it and swapped in")
    parser.add_argument("--verbose", action="store_true", help="show upstream notices")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code the run's tokenizer folder or repo ships")
    parser.add_argument("--tokenizer-name", default=None,
                        help="the tokenizer to ship (default: the run's; "
                        f"{SHIPPED_FLAG} names the shipped GPT-2 one)")
    opts = parser.parse_args(list(argv))
    if opts.max_shard_bytes < 1:
        parser.error(f"--max-shard-bytes must be >= 1, got {opts.max_shard_bytes}")
    with logging_scope(0, stream=sys.stderr):  # stdout holds the one result line
        return export_main(opts)


def export_main(opts: argparse.Namespace) -> int:
    """`loom export` with its options parsed; warning filters set here end with the scope."""
    if not opts.verbose:  # DCP's note that it loads in one process: exactly what export does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        # transformers' and peft's notices of their own deprecations (peft's check calls
        # one): nothing the user can act on
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category,
                                    module=r"(transformers|peft)(\.|$)")
    if not (opts.checkpoint / "loop.json").is_file():
        print(f"error: {opts.checkpoint} is not a loom checkpoint folder", file=sys.stderr)
        return 2
    try:
        if opts.peft:
            written = export_peft(opts.checkpoint, opts.outdir, opts.dtype,
                                  verify=not opts.no_verify, overwrite=opts.overwrite)
        else:
            written = export(opts.checkpoint, opts.outdir, opts.dtype, opts.trust_remote_code,
                             verify=not opts.no_verify, max_shard_bytes=opts.max_shard_bytes,
                             tokenizer=opts.tokenizer_name, overwrite=opts.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the staging folder is gone; the swap is never cut apart
        print(f"loom export: interrupted by Ctrl-C; {opts.outdir} holds no partial export",
              file=sys.stderr)
        return SIGINT_EXIT
    print(f"exported {opts.checkpoint} -> {opts.outdir} ({written})")
    return 0

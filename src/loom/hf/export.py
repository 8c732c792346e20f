"""`loom export`: a checkpoint's model as a Hugging Face folder transformers loads.

A native family's run goes to the architecture its adapter names (Llama, Qwen3, or
Qwen3-MoE where the MoE has that shape; otherwise one line names the feature with no
Hugging Face equivalent); a transformers-path run to its own architecture. Tensors are read
from the checkpoint and written one at a time (safetensors, sharded with an index above
5 GB), into a staging folder renamed into place only after the export checked itself:
transformers loads it, without remote code, and its logits on a fixed batch match loom's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import struct
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from loom.checkpoint.format import DATA_FILE, TensorReader
from loom.checkpoint.trust import UnusableCheckpoint, read_loop, verify_checkpoint
from loom.config import ConfigError, ModelConfig
from loom.data.hub import looks_like_hub_id
from loom.data.tokenizers import (
    SHIPPED_FLAG,
    TextTokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_name,
)
from loom.lora.converter import LoraSettings, apply_lora, merge_adapters
from loom.lora.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    base_reader,
    merging,
    peft_logits,
    peft_plan,
)
from loom.models.hf_folder import INDEX, SINGLE
from loom.models.registry import export_adapter, family
from loom.models.spec import ModelSpec
from loom.models.transformers.model import hf_model_from_config, load_hf_model
from loom.runtime.logs import setup_logging
from loom.runtime.preflight import check_host_fits
from loom.safe_io import read_json_capped, write_text_atomic

logger = logging.getLogger("loom")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}
MAX_SHARD_BYTES = 5 * 1024**3
"""Shard size above which the weights are split across files with an index, as the Hub
does."""
VERIFY_TOLERANCE = 1e-4
"""Largest |logit difference| / max |logit| accepted between transformers and loom."""


HOST_COPIES = 3
"""Copies of the weights `loom generate` and export's check hold at once (loaded, a second
model, serialised), for the memory check."""


@dataclass(frozen=True)
class RunModel:
    """What a checkpoint holds: its family, the family's arguments and the run's model
    settings (transformers-path runs: the Hugging Face name)."""

    spec: ModelSpec
    args: Any
    model_cfg: ModelConfig
    checkpoint: Path
    lora: LoraSettings | None = None
    """A LoRA run's adapters (the model is built with them)."""
    base: str | None = None
    seed: int = 0
    """A LoRA run's source (its --model) and seed: its checkpoint holds no frozen weight."""

    def build(self) -> nn.Module:
        if self.spec.name == "transformers":
            return hf_model_from_config(self.model_cfg, dtype=torch.float32)
        model = self.spec.build(self.args)
        if self.lora is not None:
            apply_lora(model, self.lora)
        return model


def run_model(checkpoint: Path) -> RunModel:
    """Verify a checkpoint and say which model it holds (nothing loaded yet)."""
    manifest = verify_checkpoint(checkpoint)
    loop = read_loop(checkpoint)
    arch = loop["architecture"]
    if arch.get("kind") == "hf":
        settings = run_config(checkpoint).get("model", {})
        model_cfg = ModelConfig(model=arch.get("model"), model_impl="transformers",
                                trust_remote_code=bool(settings.get("trust_remote_code")))
        held = RunModel(family("transformers"), model_cfg, model_cfg, checkpoint)
        check_model_bytes(held, manifest, f"{arch.get('model')}/config.json: the sizes of "
                                          f"the model checkpoint {checkpoint} trained")
        return held
    name = arch.get("family") or ("moe" if arch.get("kind") == "moe" else "llama")
    spec = family(name)
    model_cfg = ModelConfig(**loop["model_args"], family=name)
    lora = LoraSettings.recorded(arch)
    base = run_config(checkpoint).get("model", {}).get("model") if lora else None
    held = RunModel(spec, spec.args_from_config(model_cfg), model_cfg, checkpoint, lora, base,
                    loop["settings"].get("seed", 0))
    check_model_bytes(held, manifest, f"checkpoint {checkpoint} is unsafe: loop.json "
                                      "model_args")
    return held


def check_model_bytes(held: RunModel, manifest: dict[str, Any], source: str) -> None:
    """The model that `source` (the checkpoint's `model_args`, or for transformers' module
    the config.json of the folder it trained from) describes is no larger than the
    checkpoint's data files (which hold its fp32 weights), and fits in memory with its
    buffers, before anything is allocated: a crafted `max_seq_len` or `dim` stops here in
    one line."""
    with torch.device("meta"):
        model = held.build()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
                  or held.lora is None)  # a LoRA checkpoint holds no frozen weight
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    stored = sum(r["bytes"] for name, r in manifest["files"].items() if DATA_FILE.match(name))
    if weights > stored:
        raise UnusableCheckpoint(f"{source} describe {weights:,} bytes of weights, its data "
                                 f"files hold {stored:,}")
    check_host_fits(HOST_COPIES * weights + buffers, f"the model of {held.checkpoint}")


def read_state(checkpoint: Path, state: dict[str, torch.Tensor]) -> None:
    """Fill `state` (names as in the model) from the checkpoint with loom's pickle-free
    reader; only the named tensors are read."""
    try:
        with warnings.catch_warnings():  # its note that it loads in one process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, storage_reader=TensorReader(checkpoint), no_dist=True)
    except CheckpointException as e:  # a BaseException: names the first rank's failure
        failure = next(iter(e.failures.values()), (e,))[0]
        reason = f"{type(failure).__name__}: {failure}"
        raise UnusableCheckpoint(f"checkpoint {checkpoint} cannot be loaded: "
                                 f"{' '.join(reason.split())[:300]}") from None


def load_run_model(checkpoint: Path) -> tuple[nn.Module, RunModel]:
    """The checkpoint's whole model in this one process (fp32, training mode); a LoRA
    run's frozen base from the run's source."""
    held = run_model(checkpoint)
    model = held.build()
    state = model.state_dict()
    frozen = frozen_names(model)
    read_state(checkpoint, {n: t for n, t in state.items() if n not in frozen})
    if frozen:
        read_base = base_reader(held.spec, held.args, held.base, held.seed)
        for name in frozen:
            state[name].copy_(read_base(name))
    model.load_state_dict(state)
    return model, held


def frozen_names(model: nn.Module) -> set[str]:
    """The parameters a checkpoint of this (built) model does not hold."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def run_reader(held: RunModel, shapes: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    """Each tensor of the run's model by name: from the checkpoint, or for a LoRA run's
    frozen base, from the run's source."""
    saved = reader(held.checkpoint, shapes)
    if held.lora is None:
        return saved
    with torch.device("meta"):
        frozen = frozen_names(held.build())
    base = base_reader(held.spec, held.args, held.base, held.seed)
    return lambda name: base(name) if name in frozen else saved(name)


def load_model_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The checkpoint's full model state and its family's arguments."""
    model, held = load_run_model(checkpoint)
    return model.state_dict(), held.args


def run_tokenizer(checkpoint: Path) -> str | None:
    """The tokenizer of the run that saved `checkpoint`, from its run folder's config.json
    (None: the shipped one)."""
    settings = run_config(checkpoint)
    return tokenizer_name(settings.get("data", {}).get("tokenizer_name"),
                          settings.get("model", {}).get("model"))


def run_config(checkpoint: Path) -> dict[str, Any]:
    """The `data` and `model` tables of the config.json of the run that saved `checkpoint`
    ({} where there is none); the names in them must be strings or null."""
    config = checkpoint.parent.parent / "config.json"
    if not config.exists() and not config.is_symlink():
        return {}
    try:
        settings = read_json_capped(config)
        tables = {k: settings.get(k, {}) for k in ("data", "model")}
        if not all(isinstance(t, dict) for t in tables.values()) or not all(
                isinstance(t.get(k), str | None) for t, k in
                ((tables["data"], "tokenizer_name"), (tables["model"], "model"))):
            raise ValueError("tokenizer_name or model is not a name")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{config} is unusable ({e}); nothing was written") from None
    return tables


Tensors = Callable[[Callable[[str], torch.Tensor]], Iterator[tuple[str, torch.Tensor]]]
"""Given a reader of loom tensors by name, the exported (name, tensor) pairs in order."""


def export_plan(held: RunModel, dtype: str, peft: bool = False
                ) -> tuple[dict[str, Any], Tensors, dict[str, Any]]:
    """(config.json, the tensors to write, loom shapes by name) of the export; a model with
    no Hugging Face equivalent fails here, in one line, before anything is written. A LoRA
    run's adapters are merged, or with `peft` are the export (`loom.lora.export`)."""
    with torch.device("meta"):
        model = held.build()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if held.spec.name == "transformers":
        config = json.loads(model.hf.config.to_json_string())
        config["dtype"] = "float32" if dtype == "fp32" else "bfloat16"
        names = [name for name, _ in model.named_parameters()] + [
            name for name, _ in model.named_buffers() if name in shapes]

        def tensors(read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                yield name.removeprefix("hf."), read(name)

        return config, tensors, shapes
    try:
        adapter = export_adapter(held.spec, held.args)
    except ConfigError as e:
        raise ConfigError(f"cannot export {held.checkpoint}: {e}; nothing was written") from None
    args = adapter.settle(held.args, run_reader(held, shapes))
    if peft:
        return peft_plan(adapter, args, held.lora, shapes, run_reader(held, shapes),
                         run_config(held.checkpoint).get("model", {}).get("model"))
    if held.lora is None:
        return adapter.hf_config(args, dtype), lambda read: adapter.hf_tensors(args, read), shapes
    return adapter.hf_config(args, dtype), lambda read: adapter.hf_tensors(
        args, merging(read, held.lora, list(shapes))), shapes


def shard_layout(entries: list[tuple[str, torch.Size, torch.dtype]],
                 limit: int) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """Consecutive tensors grouped into shards of at most `limit` bytes (a larger tensor
    gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for name, shape, dt in entries:
        nbytes = math.prod(shape) * dt.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dt))
        size += nbytes
    return shards


def safetensors_header(shard: list[tuple[str, torch.Size, torch.dtype]]) -> bytes:
    """The header of a safetensors file holding `shard` in order: an 8-byte length, then
    JSON padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt in shard:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dt], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_weights(folder: Path, tensors: Tensors, read: Callable[[str], torch.Tensor],
                  shapes: dict[str, Any], dt: torch.dtype, limit: int,
                  single: str = SINGLE) -> int:
    """Stream the exported tensors into safetensors files (one in memory at a time); the
    layout is planned first from meta tensors of the same shapes. Returns the file count."""
    entries = [(name, tuple(t.shape), dt) for name, t in
               tensors(lambda n: torch.empty(shapes[n], device="meta"))]
    shards = shard_layout(entries, limit)
    files = ([single] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    stream = tensors(read)
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        with open(folder / file, "wb") as f:
            f.write(safetensors_header(shard))
            for name, shape, _ in shard:
                got, tensor = next(stream)
                assert got == name and tuple(tensor.shape) == shape, (got, name)
                f.write(tensor.detach().to(dt).contiguous().view(torch.uint8).numpy().tobytes())
                weight_map[name] = file
    if len(files) > 1:
        total = sum(math.prod(s) * dt.itemsize for _, s, _ in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(folder / INDEX, json.dumps(index, indent=2) + "\n")
    return len(files)


def reader(checkpoint: Path, shapes: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    def read(name: str) -> torch.Tensor:
        state = {name: torch.empty(shapes[name])}
        read_state(checkpoint, state)
        return state[name]

    return read


def generation_config(tokenizer: TextTokenizer | None) -> dict[str, Any]:
    eos = None if tokenizer is None else tokenizer.eot_id
    return {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False,
            "transformers_version": "loom"}


def verify_export(folder: Path, checkpoint: Path, dtype: str) -> float:
    """Load the export with transformers (CPU, no remote code) and compare its logits on a
    fixed batch with loom's own model of the checkpoint (its weights rounded to `dtype` as
    exported; a LoRA run's adapters merged first, as exported); returns the largest
    difference relative to the largest logit."""
    model, held = load_run_model(checkpoint)
    if held.lora is not None:
        merge_adapters(model)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(DTYPES[dtype]))
    hf = load_hf_model(ModelConfig(model=str(folder.resolve())))
    vocab = hf.hf.config.vocab_size
    tokens = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.eval()(tokens)
    return compare_logits(model, tokens, theirs, "transformers'")


def compare_logits(model: nn.Module, tokens: torch.Tensor, theirs: torch.Tensor,
                   whose: str) -> float:
    """The largest difference between loom's logits and `theirs`, relative to loom's
    largest; a ConfigError above the tolerance."""
    with torch.no_grad():
        ours = model.eval()(tokens).float()
    diff = float((ours - theirs.float()).abs().max() / ours.abs().max().clamp(min=1e-30))
    if not diff <= VERIFY_TOLERANCE:
        raise ConfigError(f"export check failed: {whose} logits differ from loom's by "
                          f"{diff:.2e} of the largest (tolerance {VERIFY_TOLERANCE:g}); "
                          "nothing was written")
    return diff


@contextmanager
def staged(outdir: Path) -> Iterator[Path]:
    """A staging folder beside `outdir` whose files are moved into it only when the block
    succeeds (the folder is removed when it fails): no half-written export."""
    staging = outdir.parent / f".{outdir.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    outdir.mkdir(parents=True, exist_ok=True)
    for item in staging.iterdir():
        item.replace(outdir / item.name)
    staging.rmdir()


def check_peft(folder: Path, checkpoint: Path, base: str, dtype: str) -> float:
    """peft loads the adapter folder on the run's base folder with loom's logits (its
    adapters rounded to `dtype` as exported)."""
    model, _ = load_run_model(checkpoint)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".lora_" in name:
                tensor.copy_(tensor.to(DTYPES[dtype]))
    hf = load_hf_model(ModelConfig(model=base)).hf
    tokens = torch.randint(hf.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    return compare_logits(model, tokens, peft_logits(folder, hf, tokens), "peft's")


def export_peft(checkpoint: Path, outdir: Path, dtype: str, verify: bool) -> str:
    """Write a LoRA run's adapters as a PEFT folder (`loom.lora.export`), checked by peft."""
    held = run_model(checkpoint)
    if held.lora is None:
        raise ConfigError(f"--peft needs a LoRA run's checkpoint; {checkpoint} trained every "
                          "weight (export the model without --peft)")
    config, tensors, shapes = export_plan(held, dtype, peft=True)
    with staged(outdir) as staging:
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
           max_shard_bytes: int = MAX_SHARD_BYTES, tokenizer: str | None = None) -> str:
    """Write the model, its config and generation config, and the tokenizer (`tokenizer`,
    else the run's) when one is found and the embedding covers it; returns what was written,
    for the one line `loom export` prints."""
    held = run_model(checkpoint)
    config, tensors, shapes = export_plan(held, dtype)
    tokenizer_id, text_tokenizer = export_tokenizer(checkpoint, tokenizer, trust_remote_code)
    vocab = config.get("vocab_size", 0)
    with staged(outdir) as staging:
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
    parser = argparse.ArgumentParser(prog="loom export",
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
    parser.add_argument("--verbose", action="store_true", help="show upstream notices")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code the run's tokenizer folder or repo ships")
    parser.add_argument("--tokenizer-name", default=None,
                        help="the tokenizer to ship (default: the run's; "
                        f"{SHIPPED_FLAG} names the shipped GPT-2 one)")
    opts = parser.parse_args(list(argv))
    setup_logging(0, stream=sys.stderr)  # stdout holds the one result line
    if not opts.verbose:  # DCP's note that it loads in one process: exactly what export does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    if not (opts.checkpoint / "loop.json").is_file():
        print(f"error: {opts.checkpoint} is not a loom checkpoint folder", file=sys.stderr)
        return 2
    try:
        if opts.peft:
            written = export_peft(opts.checkpoint, opts.outdir, opts.dtype,
                                  verify=not opts.no_verify)
        else:
            written = export(opts.checkpoint, opts.outdir, opts.dtype, opts.trust_remote_code,
                             verify=not opts.no_verify, max_shard_bytes=opts.max_shard_bytes,
                             tokenizer=opts.tokenizer_name)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {opts.checkpoint} -> {opts.outdir} ({written})")
    return 0

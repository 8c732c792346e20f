"""A LoRA run's export: merged into the base weights, or as a PEFT adapter folder.

Merged: each adapted linear's weight is read as W + (alpha / r) B A, so the family's
Hugging Face adapter writes a plain model (`loom export` checks it with transformers as for
any run). PEFT: `adapter_config.json` and `adapter_model.safetensors` holding A and B under
the names peft gives the Hugging Face model's modules
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), for
`peft.PeftModel.from_pretrained` on the run's base folder.

The Hugging Face layout of B is the family's own export applied to it in place of the
weight (a q/k projection's rows are permuted per head; A's columns never are): that holds
when the export transforms a weight's rows only, which is checked on every adapter
(T(B) A == T(B A)) rather than assumed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.hf.checkpoint import HFCheckpoint
from loom.hf.load import local_folder
from loom.lora.converter import LoraSettings, adapted_weights, merged
from loom.models.spec import HFAdapter, ModelSpec
from loom.parallel.init import clean_name, seeded_value

Read = Callable[[str], torch.Tensor]
PEFT_PREFIX = "base_model.model."
"""What peft puts before the Hugging Face model's own module names."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def base_reader(spec: ModelSpec, args: Any, source: str | None, seed: int) -> Read:
    """The frozen base of a LoRA run by loom name, from where the run took it: its Hugging
    Face folder (read through the family's adapter, checked against the model first), or
    drawn from the seed as the run's init drew it (as are the modules the folder lacks
    wholly, DeepSeek-V3's MTP: `HFCheckpoint.fresh`)."""
    with torch.device("meta"):
        plain = spec.new(args)
    shapes = {name: p.shape for name, p in plain.named_parameters()}

    def draw(name: str) -> torch.Tensor:
        return seeded_value(shapes[name], plain.init_std(name), seed, name)
    if source is None or not ModelConfig(model=source).from_hub_format:
        return draw
    try:
        folder = local_folder(ModelConfig(model=source))
        checkpoint = HFCheckpoint(folder, spec.hf[0], args)
        checkpoint.check(plain, clean_name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the base of this LoRA run, {source}, cannot be read: "
                          f"{e}") from None
    return lambda name: draw(name) if name.startswith(checkpoint.fresh) else checkpoint.read(
        name)


def merging(read: Read, lora: LoraSettings, names: list[str]) -> Read:
    """`read` with every adapted linear's weight merged (`names`: the checkpoint's)."""
    adapted = adapted_weights(names)

    def read_merged(name: str) -> torch.Tensor:
        prefix = adapted.get(name)
        if prefix is None:
            return read(name)
        return merged(read(name), read(f"{prefix}.lora_A"), read(f"{prefix}.lora_B"),
                      lora.scale)
    return read_merged


def in_hf_layout(adapter: HFAdapter, args: Any, shapes: dict[str, Any],
                 given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export of the loom tensors in `given` (by weight name, any row count) under
    their Hugging Face names: one pass of the family's export, every other tensor on meta."""
    def read(name: str) -> torch.Tensor:
        return given[name] if name in given else torch.empty(shapes[name], device="meta")

    hf_names = {adapter.sources(args)[name][0][0]: name for name in given}
    return {hf: t for hf, t in adapter.hf_tensors(args, read) if hf in hf_names}


def peft_tensors(adapter: HFAdapter, args: Any, lora: LoraSettings, shapes: dict[str, Any],
                 read: Read) -> dict[str, torch.Tensor]:
    """The adapter file's tensors under peft's names; refused in one line where the
    family's export of an adapted weight is not a reordering of its rows."""
    adapted = adapted_weights(list(shapes))
    sources = adapter.sources(args)
    for weight in adapted:
        if len(sources.get(weight, ((),))[0]) != 1:
            raise ConfigError(f"cannot write a PEFT adapter for {weight}: its Hugging Face "
                              "tensor is not one weight")
    a = {w: read(f"{p}.lora_A") for w, p in adapted.items()}
    b = {w: read(f"{p}.lora_B") for w, p in adapted.items()}
    hf_b = in_hf_layout(adapter, args, shapes, b)
    hf_product = in_hf_layout(adapter, args, shapes, {w: b[w] @ a[w] for w in adapted})
    out: dict[str, torch.Tensor] = {}
    for weight in adapted:
        hf = sources[weight][0][0]
        if not torch.allclose(hf_b[hf] @ a[weight], hf_product[hf], rtol=1e-5, atol=1e-7):
            raise ConfigError(f"cannot write a PEFT adapter for {weight}: the Hugging Face "
                              "export mixes its input features")
        module = PEFT_PREFIX + hf.removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = a[weight]
        out[f"{module}.lora_B.weight"] = hf_b[hf]
    return out


def adapter_config(lora: LoraSettings, tensors: dict[str, torch.Tensor],
                   base: str) -> dict[str, Any]:
    """peft's LoraConfig as JSON; the target modules by full name (exact: a leaf name such
    as `gate_proj` would also match a MoE's experts)."""
    modules = sorted({name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for name in tensors})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None}


def peft_plan(adapter: HFAdapter, args: Any, lora: LoraSettings, shapes: dict[str, Any],
              read: Read, base: str | None
              ) -> tuple[dict[str, Any], Callable[[Read], Iterator[tuple[str, torch.Tensor]]],
                         dict[str, Any]]:
    """(adapter_config.json, the tensors to write, their shapes), as `export_plan` gives
    them for a model; a run whose base is no Hugging Face model is refused in one line."""
    if base is None:
        raise ConfigError("--peft needs a run that trained from a Hugging Face model (the "
                          "adapter's base); this run's base is loom's own init: export the "
                          "merged model instead")
    tensors = peft_tensors(adapter, args, lora, shapes, read)
    written = {name: tuple(t.shape) for name, t in tensors.items()}

    def stream(read: Read) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((name, read(name)) for name in tensors)

    def lookup(name: str) -> torch.Tensor:
        return tensors[name]
    return adapter_config(lora, tensors, base), lambda _: stream(lookup), written


def peft_logits(folder: Any, base: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the adapter folder loaded by peft on `base` (transformers' model of
    the run's base folder): what `loom export --peft` compares with loom's."""
    try:  # peft is an optional dependency (the lora extra): needed only to check --peft
        peft = importlib.import_module("peft")
    except ImportError:
        raise ConfigError("checking a --peft export needs peft (pip install 'loom[lora]'); "
                          "--no-verify skips the check") from None
    model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits

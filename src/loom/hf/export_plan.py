"""What an export writes: the Hugging Face config.json and the tensors, per model family.

A native family goes through the export adapter its registry entry names (Llama, Qwen3,
Qwen3-MoE), which settles the arguments and maps loom's tensors to Hugging Face names; a
transformers-path run keeps its own config and names. A LoRA run's adapters are merged, or
for `--peft` are the export. A model with no Hugging Face equivalent fails here, before
anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loom.config import ConfigError
from loom.hf.export_files import Tensors
from loom.hf.peft import merging, peft_plan
from loom.hf.run_checkpoint import RunModel, run_config, run_reader
from loom.models.registry import export_adapter


def export_plan(held: RunModel, dtype: str, peft: bool = False
                ) -> tuple[dict[str, Any], Tensors, dict[str, Any]]:
    """(config.json, the tensors to write, loom shapes by name) of the export; a model with
    no Hugging Face equivalent fails here, in one line, before anything is written. A LoRA
    run's adapters are merged, or with `peft` are the export (`loom.hf.peft`)."""
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

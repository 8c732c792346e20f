"""One rank of the compile-with-checkpointing reproduction (tests/parity/test_upstream_
compiled_ac.py): loom's debug model under each layout named on the command line (`tp`: its
tp 2 plan; `simple-fsdp`: SimpleFSDP over dp_shard 2) with block activation checkpointing
inside the per-block (SimpleFSDP: whole-model) aot_eager graph, the order torch's own
recipes use, forced even where `loom.parallel.parallelize.checkpoint_outside_compile` would
pick the other; one forward and backward each. Prints one JSON line: layout -> the
exception's type and first line, or null."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from loom.config import config_from_flags
from loom.models.resolve import plain_model
from loom.parallel import parallelize as recipe
from loom.parallel.compile import compiler_settings
from loom.parallel.mesh import ParallelDims
from loom.runtime.scope import applied

LAYOUTS = {"tp": {"tp": 2}, "simple-fsdp": {"data_parallel": "simple-fsdp", "dp_shard": 2}}


def one_step(layout: str) -> str | None:
    """Build the layout (validated without --compile, which is then switched on), run it."""
    cfg = config_from_flags({"model": "debug", "activation_checkpoint": "block",
                             "dtype": "fp32", **LAYOUTS[layout]}, environ={})
    parallel = replace(cfg.parallel, compile=True, compile_backend="aot_eager")
    dims = ParallelDims.from_config(parallel, dist.get_world_size())
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = plain_model(cfg)
    recipe.parallelize(model, dims, parallel, loss_parallel=False, backend="gloo")
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    with applied(compiler_settings(parallel)):
        try:
            model(tokens).float().sum().backward()
        except Exception as e:  # the reproduction reports what torch raised
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def main(layouts: list[str]) -> None:
    dist.init_process_group("gloo")
    recipe.checkpoint_outside_compile = lambda dims, cfg: False  # torch's order, always
    errors = {layout: one_step(layout) for layout in layouts}
    print(json.dumps(errors))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

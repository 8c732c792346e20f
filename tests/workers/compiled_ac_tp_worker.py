"""One rank of the compile-with-checkpointing reproduction (tests/parity/test_upstream_
compiled_ac.py): loom's debug model under its own tp 2 plan with block activation
checkpointing and per-block torch.compile (aot_eager), built past the refusal (the config
is validated without --compile, which is then switched on), one forward and backward.
Prints one JSON line: {"error": the exception's type and first line, or null}."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import torch.distributed as dist

from loom.config import config_from_flags
from loom.models.resolve import plain_model
from loom.parallel.compile import compiler_settings
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.runtime.scope import applied


def main() -> None:
    dist.init_process_group("gloo")
    cfg = config_from_flags({"model": "debug", "tp": 2, "activation_checkpoint": "block",
                             "dtype": "fp32"}, environ={})
    parallel = replace(cfg.parallel, compile=True, compile_backend="aot_eager")
    dims = ParallelDims.from_config(parallel, dist.get_world_size())
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = plain_model(cfg)
    parallelize(model, dims, parallel, loss_parallel=False, backend="gloo")
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    error = None
    with applied(compiler_settings(parallel)):
        try:
            model(tokens).float().sum().backward()
        except Exception as e:  # the reproduction reports what torch raised
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps({"error": error}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of the float8 all-gather check (2 ranks): a debug model converted by --float8
tensorwise and sharded by FSDP2 holds torchao's float8-all-gather weight subclass, and the
step hook sets each weight's scale from the amax of the whole (unsharded) weight; prints
one JSON line."""

from __future__ import annotations

import json

import torch
from torch.distributed.fsdp import fully_shard
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from loom.config import parse_args
from loom.models.resolve import plain_model
from loom.numerics import float8
from loom.parallel.mesh import ParallelDims
from loom.protocols.extensions import StepContext, after_optimizer_step
from tests.workers.bootstrap import rank_job


def main() -> None:
    with rank_job() as (info, device):
        cfg = parse_args(["--model", "debug", "--dim", "64", "--vocab-size", "256",
                          "--float8", "tensorwise", "--dtype", "fp32"])
        dims = ParallelDims.from_config(cfg.parallel, info.world_size)
        dims.build_mesh(device.type)
        with torch.device("meta"):
            model = plain_model(cfg)
        float8.convert_to_float8(model, cfg)
        mesh = dims.get_mesh("dp")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        model.init_buffers(device)
        weight = model.layers["0"].attention.wq.weight
        model(torch.randint(0, 256, (2, 16))).float().mean().backward()
        after_optimizer_step(StepContext(model, mesh.get_group(), cfg))
        local = weight._local_tensor
        full = weight.full_tensor()
        expected = torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double()
        print(json.dumps({
            "subclass": isinstance(local, WeightWithDynamicFloat8CastTensor),
            "scale": float(local._precomputed_scale), "expected": float(expected),
            "grad": float(model.layers["0"].attention.wq.weight.grad.full_tensor().abs().sum()),
        }), flush=True)


if __name__ == "__main__":
    main()

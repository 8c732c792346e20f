"""One rank of the 2-rank loss job: every --loss-impl against eager on the same inputs.

Three groups, one process group: the vocab-parallel kernels on DTensors at tp 2; one
forward + backward of the parallelized model (dp 2 and tp 2, fp32 and bf16 parameters),
whose full gradients show that the fused head's weight gradient goes through FSDP; and
5-step training runs through `loom.trainer.entry.run`. Rank 0 writes the measured differences
to the JSON file named by argv[1]; the tests decide what passes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from loom.config import LossConfig, ParallelConfig, parse_args
from loom.losses import (
    IGNORE_INDEX,
    build_loss,
    eager_cross_entropy,
    fused_linear_cross_entropy,
    vocab_parallel_cross_entropy,
)
from loom.models.llama.model import ModelArgs, Transformer
from loom.observability.metrics import read_rows
from loom.parallel.init import clean_name, init_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.trainer.entry import run
from tests.workers.bootstrap import rank_job

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=32,
                 max_seq_len=64)
LAYOUTS = {"dp2": (2, 1), "tp2": (1, 2)}  # name: (dp_shard, tp)
SEQ, CHUNK = 38, 16  # (1, 38) rows per rank, the unit tests' shape: one compiled graph
E2E_COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "101",
              "--seq-len", str(SEQ), "--batch-size", "1", "--fp32", "--max-steps", "5",
              "--seed", "7", "--lr", "1e-3", "--loss-chunk-size", str(CHUNK)]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (full(a) - full(b)).abs().max().item()


def labelled(n: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(vocab, (n,), generator=gen)
    labels[::5] = IGNORE_INDEX
    return labels


def functional_checks(mesh) -> dict[str, float | bool]:
    """Loss-parallel and vocab-parallel fused-linear on DTensors vs eager on full tensors
    (odd vocabulary: uneven shards; ignored rows; a chunk that does not divide the rows)."""
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, 16, generator=gen), torch.randn(101, 16, generator=gen) * 0.5
    y = labelled(37, 101, 1)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = eager_cross_entropy(hr @ wr.T, y)
    ref.backward()
    out: dict[str, float | bool] = {}
    for name in ("loss-parallel", "fused-linear"):
        hd = distribute_tensor(h, mesh, [Replicate()]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        if name == "loss-parallel":
            loss = vocab_parallel_cross_entropy(hd @ wd.T, y, chunk_size=8)
        else:
            loss = fused_linear_cross_entropy(hd, wd, y, chunk_size=8).to_local()
        loss.backward()
        out[f"{name}/loss"] = max_diff(loss, ref)
        out[f"{name}/grad_hidden"] = max_diff(hd.grad, hr.grad)
        out[f"{name}/grad_weight"] = max_diff(wd.grad, wr.grad)
    def sharded_model(_: object) -> DTensor:
        return distribute_tensor(h @ w.T, mesh, [Shard(-1)])

    try:
        build_loss(LossConfig("eager"), sharded_model)(sharded_model, None, y)
        out["eager_refuses_sharded_logits"] = False
    except ValueError:
        out["eager_refuses_sharded_logits"] = True
    return out


def build_model(dims: ParallelDims, mode: str, fp32: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    cfg = ParallelConfig(dtype="fp32" if fp32 else "bf16")
    parallelize(model, dims, cfg, loss_parallel=mode == "loss-parallel", backend="gloo")
    init_weights(model, seed=3, device=torch.device("cpu"))
    return model


def step_gradients(dims: ParallelDims, mode: str, fp32: bool) -> tuple[float, dict]:
    """Loss (dp-averaged) and full gradients of one forward + backward on this rank's rows."""
    model = build_model(dims, mode, fp32)
    loss_fn = build_loss(LossConfig(mode, CHUNK), model, dims.tp)
    tokens = torch.randint(ARGS.vocab_size, (dims.dp_shard, SEQ + 1),
                           generator=torch.Generator().manual_seed(5))
    labels = torch.where(torch.rand(tokens.shape, generator=torch.Generator().manual_seed(6))
                         < 0.2, IGNORE_INDEX, tokens)
    rows = slice(dims.dp_rank, dims.dp_rank + 1)
    loss = loss_fn(model, tokens[rows, :-1], labels[rows, 1:])
    loss.backward()
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, group=dims.get_mesh("dp").get_group())
    grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
    return reported.item() / dims.dp_size, grads


def model_checks(world: int) -> dict[str, float]:
    """Each mode vs eager through parallelize: loss and every parameter's gradient,
    reported as max |diff| (fp32) or relative norm error (bf16 parameters)."""
    out: dict[str, float] = {}
    for layout, (dp_shard, tp) in LAYOUTS.items():
        dims = ParallelDims(1, dp_shard, tp, world)
        dims.build_mesh("cpu")
        modes = ["chunked", "chunked-backward", "compiled", "fused-linear"]
        modes += ["loss-parallel"] if tp > 1 else []
        for fp32 in (True, False):
            precision = "fp32" if fp32 else "bf16"
            ref_loss, ref = step_gradients(dims, "eager", fp32)
            for mode in modes if fp32 else ["fused-linear", *modes[4:]]:
                loss, grads = step_gradients(dims, mode, fp32)
                key = f"{layout}/{precision}/{mode}"
                out[f"{key}/loss"] = abs(loss - ref_loss) / abs(ref_loss)
                out[f"{key}/output_weight"] = relative_or_abs(grads["output.weight"],
                                                              ref["output.weight"], fp32)
                out[f"{key}/all_params"] = max(relative_or_abs(grads[n], ref[n], fp32)
                                               for n in ref)
    return out


def relative_or_abs(a: torch.Tensor, b: torch.Tensor, fp32: bool) -> float:
    if fp32:
        return max_diff(a, b)
    return ((a - b).norm() / b.norm()).item()


def training_runs(root: Path, info, device) -> dict[str, object]:
    """5 steps per mode at tp 2 and at dp 2: per-step losses and the recorded loss mode."""
    runs = {f"tp2/{m}": ["--tp", "2", "--loss-impl", m]
            for m in ("eager", "chunked", "chunked-backward", "compiled", "fused-linear",
                      "loss-parallel")}
    runs |= {f"dp2/{m}": ["--dp-shard", "2", "--loss-impl", m]
             for m in ("eager", "fused-linear", "loss-parallel")}
    out: dict[str, object] = {}
    for name, flags in runs.items():
        outdir = root / name.replace("/", "_")
        run(parse_args([*E2E_COMMON, *flags, "--outdir", str(outdir)]), info, device)
        if info.rank == 0:
            rows = read_rows(outdir / "metrics-0.jsonl")
            recorded = json.loads((outdir / "config.json").read_text())["loss"]["loss_impl"]
            out[name] = {"losses": [r["train/loss"] for r in rows], "loss_impl": recorded}
    return out


def main(result_file: Path) -> None:
    with rank_job() as (info, device):
        tp_dims = ParallelDims(1, 1, 2, info.world_size)
        results = {"functional": functional_checks(tp_dims.build_mesh("cpu")["tp"]),
                   "model": model_checks(info.world_size),
                   "training": training_runs(result_file.parent, info, device)}
        if info.rank == 0:
            result_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Host memory of loading a pretrained Hugging Face model on one node: every rank reading
the checkpoint (the first path), rank 0 loading the whole model and broadcasting it (the
second, still taken for hub ids and `.bin` checkpoints) and rank 0 streaming each rank its
slices from safetensors (loom's path for local safetensors folders).

    python benchmarks/hf_load.py        # 4 gloo ranks, a 134M-parameter Llama (~6 min)

The model is a Llama built with `transformers` from a fixed seed and saved with
`save_pretrained` (safetensors) into a temporary folder, once in fp32 and once in bf16 (as
most hub checkpoints are; loom trains fp32 master weights, so each reader casts it). Each
mode is a fresh job of --nproc ranks that resolves the model, builds the mesh (dp_shard =
nproc) and loads it as `loom train` does, then stops. Node memory is the peak of the ranks'
summed PSS (proportional set size: pages of a memory-mapped checkpoint shared by several
ranks count once), sampled from /proc every 20 ms; "above idle" subtracts the ranks' summed
PSS just before loading (interpreter, torch, process group); a last job builds and allocates
the shards without loading anything (the floor). The sum of each rank's own
peak RSS (ru_maxrss) is shown too. Every mode must produce the same shards: each rank's sum
of squares of its local weights is compared.
Writes benchmarks/results/hf_load.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import free_port, rank_env

RESULTS = Path(__file__).parent / "results" / "hf_load.json"
MODES = ("every rank reads", "rank 0 broadcasts", "rank 0 streams", "native scatter")
"""The last is a native family's import: the first rank of each parameter's mesh reads it
whole and `distribute_tensor` scatters the shards (tp/pp/ep layouts need that)."""
FLOOR = "shards only, no weights"
"""The same as streaming without reading or sending anything: what building and allocating
the sharded model costs, the floor under every mode."""
SAVED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
             tie_word_embeddings=False)


def save_models(root: Path) -> int:
    """`save_pretrained` Llama folders root/fp32 and root/bf16; returns the parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    for name in SAVED_DTYPES:
        model.to(SAVED_DTYPES[name]).save_pretrained(root / name)
    return sum(p.numel() for p in model.parameters())


def pss_bytes(pid: int | str = "self") -> int:
    """The process's proportional set size; 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in text.splitlines()
                 if line.startswith("Pss:")), 0)


def load(mode: str, folder: str) -> None:
    """One rank: load as `mode` does, then print this rank's figures as one JSON line."""
    import torch.distributed as dist

    from loom.config import parse_args
    from loom.config.resolved import settled
    from loom.hf import load as hf_load
    from loom.hf.model_config import hf_model_shape
    from loom.models.resolve import plain_model
    from loom.models.transformers.model import load_hf_model
    from loom.parallel.init import load_weights
    from loom.parallel.mesh import ParallelDims
    from loom.parallel.parallelize import parallelize
    from loom.runtime.distributed import init_distributed, rank_info, teardown
    from loom.trainer.resolve import resolve_model

    info = rank_info()
    device = init_distributed(info)
    torch.set_num_threads(1)
    impl = "native" if mode == MODES[3] else "transformers"
    cfg = resolve_model(parse_args(["--model", folder, "--fp32", "--dataset", "random",
                                    "--seq-len", "128", "--dp-shard", str(info.world_size),
                                    "--model-impl", impl]))
    cfg = settled(cfg, **hf_model_shape(cfg, info.local_rank))
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    dims.build_mesh(device.type)
    dist.barrier()
    idle = pss_bytes()
    dist.barrier()
    start = time.perf_counter()
    if mode == MODES[0]:
        model = parallelize(load_hf_model(cfg.model), dims, cfg.parallel, loss_parallel=False,
                            backend="gloo")
    elif mode == MODES[3]:
        with torch.device("meta"):
            model = plain_model(cfg)
        checkpoint = hf_load.open_native_checkpoint(cfg, model)
        parallelize(model, dims, cfg.parallel, loss_parallel=False, backend="gloo")
        load_weights(model, device, checkpoint.read)
    else:
        if mode == MODES[1]:
            hf_load.safetensors_files = lambda m, model: None
        if mode == FLOOR:
            hf_load.stream_weights = lambda model, files: None
        model = hf_load.build_hf_model(cfg, dims, device, "gloo")
    dist.barrier()
    seconds = time.perf_counter() - start
    squares = sum(float(p.to_local().double().square().sum()) for p in model.parameters())
    print(json.dumps({"rank": info.rank, "idle_pss": idle, "load_s": seconds,
                      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "sum_squares": squares}), flush=True)
    teardown()


def run_mode(mode: str, folder: Path, nproc: int) -> dict:
    """A fresh job of `nproc` ranks; the peak of their summed PSS, sampled every 20 ms."""
    port = free_port()
    cmd = [sys.executable, __file__, "--worker", mode, "--folder", str(folder)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env=rank_env(r, nproc, port, env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(nproc)]
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, sum(pss_bytes(p.pid) for p in procs))
        time.sleep(0.02)
    outputs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} failed:\n{outputs[0][1][-3000:]}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    idle = sum(r["idle_pss"] for r in ranks)
    return {"saved": folder.name, "mode": mode, "nproc": nproc, "peak_sum_pss": peak,
            "idle_sum_pss": idle,
            "above_idle": peak - idle, "sum_ru_maxrss": sum(r["ru_maxrss"] for r in ranks),
            "load_s": max(r["load_s"] for r in ranks),
            "rank0_ru_maxrss": ranks[0]["ru_maxrss"],
            "sum_squares": [r["sum_squares"] for r in ranks]}


def table(results: list[dict], model_bytes: int) -> str:
    gib = 2**30
    lines = ["| saved | mode | peak PSS GiB | above idle GiB | above idle / model "
             "| sum of peak RSS GiB | rank 0 peak RSS GiB | load s |",
             "| --- | --- |" + " ---: |" * 6]
    for r in results:
        lines.append(f"| {r['saved']} | {r['mode']} | {r['peak_sum_pss'] / gib:.2f} | "
                     f"{r['above_idle'] / gib:.2f} | {r['above_idle'] / model_bytes:.2f} | "
                     f"{r['sum_ru_maxrss'] / gib:.2f} | {r['rank0_ru_maxrss'] / gib:.2f} | "
                     f"{r['load_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--worker", choices=(*MODES, FLOOR), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return load(args.worker, args.folder)
    with tempfile.TemporaryDirectory() as tmp:
        n_params = save_models(Path(tmp))
        results = [run_mode(mode, Path(tmp) / saved, args.nproc)
                   for saved in SAVED_DTYPES for mode in MODES]
        floor = run_mode(FLOOR, Path(tmp) / "fp32", args.nproc)
    ratios = {}
    for group in (results[i:i + len(MODES)] for i in range(0, len(results), len(MODES))):
        if len({json.dumps(r["sum_squares"]) for r in group[:3]}) != 1:
            raise SystemExit(f"{group[0]['saved']}: the modes built different shards: "
                             f"{[r['sum_squares'] for r in group]}")
        native, streamed = (sum(r["sum_squares"]) for r in (group[3], group[2]))
        if abs(native - streamed) > 1e-9 * streamed:  # q/k rows permuted: totals agree
            raise SystemExit(f"{group[0]['saved']}: the native import holds other weights "
                             f"(sum of squares {native} vs {streamed})")
        ratios[group[0]["saved"]] = {r["mode"]: r["above_idle"] / group[0]["above_idle"]
                                     for r in group[1:]}
    model_bytes = n_params * 4
    print(f"Llama, {n_params / 1e6:.1f}M parameters, {model_bytes / 2**30:.2f} GiB in fp32 "
          f"(trained dtype), {args.nproc} ranks on one node")
    print(table([*results, floor], model_bytes))
    for saved, by_mode in ratios.items():
        print(f"{saved}, above idle against every rank reads: "
              + ", ".join(f"{mode} {r:.2f}" for mode, r in by_mode.items()))
    summary = {"n_params": n_params, "model_bytes": model_bytes, "shape": SHAPE,
               "results": results, "floor": floor, "above_idle_ratio": ratios}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main(sys.argv[1:])

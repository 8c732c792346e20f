"""torchtitan's own trainer on loom's shape, one process: the device check's outside baseline.

    python3 benchmarks/devcheck/titan.py SPEC-JSON     # prints one JSON line last

SPEC: `flags` (the row's `loom train` flags: the shape, batch and sequence come from loom's
own config of them, so they are the row's by construction), steps, warmup, ac (loom's --ac),
compile, compile_backend.
torchtitan's llama3 model and its parallelize (per-block compile, activation checkpointing,
bf16 autocast at one device), optimizer (fused AdamW), loss and train loop run as they do in
`torchtitan.train`; only the data is random tokens (a registered train spec with no
tokenizer), so no dataset or tokenizer files are needed. Each step is timed by device events
around torchtitan's `train_step` (host clock after a synchronise off CUDA), and only step 1
logs (log_freq past the last step), as loom's rows do. Off CUDA (the rehearsal) torchtitan's
device globals are pointed at the CPU and gloo: torchtitan assumes an accelerator.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import types

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from clock import StepClock  # noqa: E402  (run as a script: this folder is on the path)

AC_MODES = {"none": ("none", None), "block": ("full", None), "full": ("full", None),
            "selective": ("selective", "op"), "op": ("selective", "op")}
"""loom's --ac -> torchtitan's activation_checkpoint (mode, selective option): loom's 'op'
saves attention and every other matmul, torchtitan's per-op policy saves mm and attention:
the nearest of its modes."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_titan() -> str | None:
    """Import what the run needs; None, or why `datasets` was replaced by a stub. torchtitan's
    llama3 package imports Hugging Face `datasets` for its text loader, which this check never
    calls (random tokens): where the carried `datasets` does not import on the GPU machine's
    packages, a stub that raises when called stands in, and the row says so."""
    why = None
    try:
        import datasets  # noqa: F401
    except Exception as e:
        why = f"datasets stubbed ({type(e).__name__}: {e})"[:300]

        def unavailable(*args, **kwargs):
            raise RuntimeError("the device check stubbed `datasets`")

        stub, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset = type("Dataset", (), {}), unavailable
        dist.split_dataset_by_node, stub.distributed = unavailable, dist
        sys.modules.update({"datasets": stub, "datasets.distributed": dist})
    import torchtitan.models.llama3
    import torchtitan.train  # noqa: F401
    return why


def point_at_cpu() -> None:
    """torchtitan picks 'cuda' when no accelerator is found; the rehearsal runs on the CPU,
    with a device module that answers torchtitan's memory-monitor calls with nothing."""
    import types

    import torch

    cpu = types.SimpleNamespace(
        set_device=lambda *_: None, current_device=lambda: 0, synchronize=lambda *_: None,
        get_device_name=lambda *_: "cpu", empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *_: None, memory_stats=lambda *_: {},
        get_device_properties=lambda *_: types.SimpleNamespace(total_memory=2**30),
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type, module.device_module = "cpu", cpu


def loom_shape(flags: list[str]) -> dict:
    """The row's model, batch and sequence as loom resolves its flags, and loom's
    parameter count (built on the meta device: no memory, no time)."""
    import torch

    import loom.families  # noqa: F401  (registers loom's model families)
    from loom.config import parse_args
    from loom.models.moe.flags import moe_flags
    from loom.models.resolve import model_args, plain_model

    cfg = parse_args(flags)
    if moe_flags(cfg.model).n_experts:  # MoE's fields are its family's flags (issue #56)
        raise SystemExit("error: torchtitan's llama3 has no mixture of experts")
    args = model_args(cfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in plain_model(cfg).parameters())
    return {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
            "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
            "hidden_dim": args.ffn_hidden_dim, "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "seq_len": cfg.data.seq_len,
            "batch": cfg.train.batch_size, "loom_parameters": params}


def titan_args(spec: dict):
    """TransformerModelArgs with loom's hidden size: torchtitan rounds 2/3 * 4 * dim up to
    `multiple_of`; with multiple_of = loom's hidden size and no multiplier it lands on it."""
    from torchtitan.models.llama3 import TransformerModelArgs

    base = int(2 * 4 * spec["dim"] / 3)
    if base > spec["hidden_dim"]:
        raise SystemExit(f"error: hidden size {spec['hidden_dim']} below torchtitan's "
                         f"2/3 * 4 * dim = {base}")
    return TransformerModelArgs(
        dim=spec["dim"], n_layers=spec["n_layers"], n_heads=spec["n_heads"],
        n_kv_heads=spec["n_kv_heads"], vocab_size=spec["vocab_size"],
        multiple_of=spec["hidden_dim"], norm_eps=spec["norm_eps"],
        rope_theta=spec["rope_theta"], max_seq_len=spec["seq_len"])


def register(spec: dict) -> None:
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.models.llama3 import Transformer, parallelize_llama
    from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

    batch, seq, vocab = spec["batch"], spec["seq_len"], spec["vocab_size"]

    class RandomTokens(BaseDataLoader):
        def __iter__(self):
            gen = torch.Generator().manual_seed(0)
            while True:
                tokens = torch.randint(vocab, (batch, seq + 1), generator=gen)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    register_train_spec("loomcheck", TrainSpec(
        model_cls=Transformer, model_args={"row": titan_args(spec)},
        parallelize_fn=parallelize_llama, pipelining_fn=None,
        build_optimizers_fn=build_optimizers, build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=lambda **_: RandomTokens(), build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss))


def job_config(spec: dict, folder: str):
    from torchtitan.config import JobConfig

    cfg = JobConfig()
    cfg.job.dump_folder = folder
    cfg.model.name, cfg.model.flavor = "loomcheck", "row"
    t = cfg.training
    t.local_batch_size, t.seq_len, t.steps = spec["batch"], spec["seq_len"], spec["steps"]
    t.mixed_precision_param = "bfloat16"
    cfg.metrics.log_freq = spec["steps"] + 1000  # step 1 logs, the timed steps do not
    cfg.lr_scheduler.warmup_steps = 1
    mode, option = AC_MODES[spec["ac"]]
    cfg.activation_checkpoint.mode = mode
    if option:
        cfg.activation_checkpoint.selective_ac_option = option
    cfg.compile.enable = spec["compile"]
    cfg.compile.backend = spec["compile_backend"]
    return cfg


def run(spec: dict) -> dict:
    import torch
    import torchtitan
    from torchtitan.train import Trainer

    cuda = torch.cuda.is_available()
    if not cuda:
        point_at_cpu()
    register(spec)

    clock = StepClock(cuda)

    class Timed(Trainer):
        def train_step(self, data_iterator):
            with clock.step():
                super().train_step(data_iterator)

    with tempfile.TemporaryDirectory() as folder:
        trainer = Timed(job_config(spec, folder))
        params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        try:
            trainer.train()
        finally:
            trainer.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {**clock.summary(spec["warmup"]), "parameters": params,
            "loom_parameters": spec["loom_parameters"],
            "same_parameter_count": params == spec["loom_parameters"], "alloc_peak_gib": peak,
            "datasets_stub": spec["stub"],
            "torchtitan": getattr(torchtitan, "__version__", "?"), "torch": torch.__version__}


def main() -> int:
    if sys.argv[1] == "--probe":  # the check asks once whether torchtitan can run here
        print(json.dumps({"stub": import_titan()}), flush=True)
        return 0
    spec = json.loads(sys.argv[1])
    spec["stub"] = import_titan()
    spec.update(loom_shape(spec["flags"]))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run(spec)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

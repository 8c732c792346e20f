"""The device check's rows, in the order they run: what answers the issue's goals first, so
a run that meets its budget early still holds them. One H200 (`gpu`) or a CPU rehearsal
(`tiny`: the same rows and code at toy sizes, fewer of them, only s-b4 compiled and with
torchtitan beside it: process starts and compiles are what a 2-core CPU is slow at)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

LOSSES = ("eager", "chunked", "chunked-backward", "compiled", "fused-linear")
"""--loss-impl values that differ at one device (loss-parallel needs tp > 1)."""


@dataclass(frozen=True)
class Row:
    """One loom run and its baselines. `flags`: the `loom train` flags of the shape and mode
    (the check adds --ac, --dtype, --max-steps, --log-every, the data and the folder)."""

    name: str
    flags: tuple[str, ...]
    steps: int
    warmup: int
    """Steps after the first left out of the median (compilation, allocator warm-up)."""
    budget_s: float
    """The most the loom run may take; each baseline gets the same. At world size 1 loom
    compiles the whole model as one graph: its cold compile grows with the layer count
    (H200, torch 2.11: s's first step 41 s; xl and m did not finish in 75 s and 60 s)."""
    ac: str = "plan"
    """'plan': the lightest --ac whose `loom plan` fits; or a fixed mode."""
    plain: bool = True
    titan: bool = True
    base: str | None = None
    """The row this one is compared with (float8 against bf16, losses against eager)."""
    profile_wait: int = 0
    """> 0: profile 3 steps after this many (and one tracer warm-up step); only the steps
    before the profiler starts are timed, so the trace costs no process of its own."""
    plan: bool = True
    notes: tuple[str, ...] = field(default=())


def gpu_rows() -> list[Row]:
    s = ("--model", "s", "--compile")
    rows = [
        Row("s-b4", (*s, "--batch-size", "4"), 16, 3, 100, profile_wait=11),
        Row("xl", ("--model", "xl", "--compile"), 12, 3, 150),
        Row("agpt-2b", ("--model", "agpt-2b", "--compile"), 10, 3, 110),
        Row("s-b4-graphs", (*s, "--batch-size", "4", "--cuda-graphs"), 16, 3, 100,
            plain=False, titan=False, base="s-b4",
            notes=("s-b4 replayed as CUDA graphs: its first run left the GPU idle 69 % "
                   "of the step (host-bound); vs base is the replay's speed-up",)),
        Row("xl-float8", ("--model", "xl", "--compile", "--float8", "tensorwise"), 12, 3, 75,
            plain=False, titan=False, base="xl"),
        Row("m", ("--model", "m", "--compile"), 12, 3, 120),
        Row("s-b8", (*s, "--batch-size", "8"), 15, 3, 60, titan=False),
        Row("s-b16", (*s, "--batch-size", "16"), 15, 3, 60, titan=False),
        Row("moe", ("--model", "moe-16b", "--n-layers", "4", "--compile"), 10, 3, 150,
            titan=False, notes=("moe-16b's shape at 4 layers (1 dense, 3 MoE): the 27-layer "
                                "model's states do not fit one GPU",)),
    ]
    loss = ("--model", "agpt-2b", "--batch-size", "1")
    rows += [Row(f"loss-{impl}", (*loss, "--loss-impl", impl), 6, 2, 45, ac="none",
                 plain=False, titan=False, base=None if impl == "eager" else "loss-eager")
             for impl in LOSSES]
    return rows


TOY = ("--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
       "--multiple-of", "32", "--seq-len", "64", "--vocab-size", "512")
TINY_ROWS = ("s-b4", "s-b8", "xl-float8", "moe", "loss-eager", "loss-chunked")


def tiny_row(row: Row) -> Row:
    """`row` at toy sizes on the CPU: the model flags become TOY (MoE: moe-debug's, 2
    layers), only s-b4 stays compiled (aot_eager: a cold inductor compile is minutes on two
    cores), budgets and steps shrink."""
    flags = list(row.flags)
    model = flags[flags.index("--model") + 1]
    del flags[flags.index("--model"):flags.index("--model") + 2]
    if "--n-layers" in flags:
        del flags[flags.index("--n-layers"):flags.index("--n-layers") + 2]
    if model.startswith("moe"):
        shape = ("--model", "moe-debug", "--n-layers", "2", "--seq-len", "64",
                 "--vocab-size", "512")
    else:
        shape = TOY
    if "--compile" in flags:
        flags.remove("--compile")
        if row.name == "s-b4":
            flags += ["--compile", "--compile-backend", "aot_eager"]
    if "--batch-size" not in flags:
        flags += ["--batch-size", "2"]
    return replace(row, flags=(*shape, *flags), steps=10 if row.profile_wait else 6,
                   warmup=2, budget_s=90, profile_wait=5 if row.profile_wait else 0,
                   titan=row.name == "s-b4", plain=row.name in ("s-b4", "moe"))


def rows_for(mode: str) -> list[Row]:
    if mode == "gpu":
        return gpu_rows()
    return [tiny_row(r) for r in gpu_rows() if r.name in TINY_ROWS]

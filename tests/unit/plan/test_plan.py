"""`loom plan` helpers: the search space and the launch lines it prints; what --compile
keeps of a block's activations."""

import pytest

from loom.config import JobConfig, parse_args
from loom.config.resolved import settled
from loom.models.resolve import plain_model
from loom.observability.flops import count_step_flops
from loom.parallel.mesh import ParallelDims
from loom.plan.command import planned_doc_mask
from loom.plan.compiled import compiled_block_fraction
from loom.plan.memory import extrapolate, held_in_phase, traced_depths
from loom.plan.pipeline_memory import others_alive, schedule_actions
from loom.plan.search import candidates, launch_line, unsearched
from loom.plan.speed import _flops_per_sample, comm_seconds


def settled_candidates(argv: list[str], world: int = 4) -> list[JobConfig]:
    """The search's candidates for `argv`'s flags, each settled as `search` settles it."""
    cfg = parse_args(argv)
    return [settled(cfg, **s) for s in candidates(cfg, world)]


def test_unsearched_drops_the_flags_the_search_sets():
    argv = ["--model", "debug", "--tp", "2", "--ac=block", "--compile", "--fp32",
            "--batch-size", "4", "--pp", "2", "--pp-microbatches=4", "--cp", "2",
            "--pp-schedule", "gpipe", "--seq-len", "128"]
    assert unsearched(argv) == ["--model", "debug", "--fp32", "--seq-len", "128"]


def test_candidates_are_valid_and_their_launch_lines_parse_back():
    base = ["--model", "debug", "--fp32", "--seq-len", "128"]
    cfg = parse_args(base)
    found = [settled(cfg, **s) for s in candidates(cfg, 4)]
    layouts = {(c.parallel.tp, c.parallel.dp_replicate, c.parallel.pp, c.parallel.cp)
               for c in found}
    # debug: 2 kv heads (no tp 4), 4 blocks (pp 2 at most: >= 2 a stage)
    assert layouts == {(1, 1, 1, 1), (1, 2, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1),
                       (1, 1, 2, 1), (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2),
                       (1, 1, 1, 2), (1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 1, 4)}, layouts
    assert {c.loss.loss_impl for c in found if c.parallel.pp == 1} == {"fused-linear"}
    assert {c.loss.loss_impl for c in found if c.parallel.pp > 1 and c.parallel.tp > 1} \
        == {"chunked-backward"}
    assert {c.parallel.activation_checkpoint for c in found} == {"none", "selective", "op",
                                                                 "block"}
    piped = [c for c in found if c.parallel.pp > 1]
    assert {(c.train.batch_size, c.parallel.pp_microbatches) for c in piped} == \
        {(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)}
    special = [c for c in found if c.parallel.pp > 1 or c.parallel.cp > 1]
    for c in found[:: max(1, len(found) // 25)] + special[:: max(1, len(special) // 25)]:
        line = launch_line(c, 4, base)
        argv = line.split(" loom train ", 1)[1].split()
        back = parse_args(argv)
        assert back.parallel == c.parallel and back.loss == c.loss, line
        assert back.train.batch_size == c.train.batch_size, line
        ParallelDims.from_config(back.parallel, 4)


def test_in_flight_micro_batches_follow_the_schedule():
    """GPipe holds every micro-batch; 1F1B pp - rank (torch runs 1F1B with fewer
    micro-batches than stages as GPipe); interleaved: torch's warm-up forwards + 1."""
    def in_flight(cfg, rank: int) -> int:  # the most forwards whose backward has not run
        live = peak = 0
        for _, is_forward in schedule_actions(cfg, rank):
            live += 1 if is_forward else -1
            peak = max(peak, live)
        return peak

    def flights(*flags: str) -> list[int]:
        cfg = parse_args(["--model", "debug", "--batch-size", "8", *flags])
        return [in_flight(cfg, rank) for rank in range(cfg.parallel.pp)]

    assert flights("--pp", "4", "--pp-microbatches", "8") == [4, 3, 2, 1]
    assert flights("--pp", "2", "--pp-microbatches", "1") == [1, 1]
    assert flights("--pp", "4", "--pp-microbatches", "2") == [2, 2, 2, 2]
    assert flights("--pp", "2", "--pp-schedule", "gpipe", "--pp-microbatches", "4") == [4, 4]
    # 2 stages a rank, 4 micro-batches in rounds of pp = 2: (2 - 1) x 2 + 2 (pp - 1 - rank) + 1
    assert flights("--pp", "2", "--pp-schedule", "interleaved-1f1b",
                   "--pp-microbatches", "4") == [5, 3]


def test_other_micro_batches_alive_before_and_after_the_first_backward():
    """(most beside a computation up to the rank's first backward, most after it), one
    byte a micro-batch: GPipe's first backward sees the other 3, its second 2; 1F1B's rank
    0 (one warm-up forward) never has more than one other in flight."""
    kept = [{"Activation": 1}]

    def beside(*flags: str) -> list[tuple[int, int]]:
        cfg = parse_args(["--model", "debug", "--batch-size", "4", "--pp", "2",
                          "--pp-microbatches", "4", *flags])
        return [tuple(sum(b.values()) for b in others_alive(cfg, rank, kept))
                for rank in range(2)]

    assert beside("--pp-schedule", "gpipe") == [(3, 2), (3, 2)]
    assert beside() == [(1, 1), (0, 0)]


def test_held_gradients_count_in_every_later_phase_gathered_weights_only_before_blocks():
    held = {"Unsharded Grad": 3, "Unsharded Param": 2}
    embedding = "tok_embeddings"
    assert held_in_phase("FSDPTransformer.layers.last|Peak Forward", held, embedding) == {
        "Unsharded Grad": 3}
    assert held_in_phase("FSDPTransformer.tok_embeddings|Peak Backward", held,
                         embedding) == held
    assert held_in_phase("peak", held, "tok_embeddings") == {"Unsharded Grad": 3}
    assert held_in_phase("FSDPTransformer.layers.last|Peak Forward|first", held,
                         "tok_embeddings") is None


def test_compiled_block_keeps_less_the_lower_the_budget():
    """The partitioner's saved set, weighed against eager: below 1 even at budget 1 (the
    RMSNorm and SiLU intermediates are recomputed), shrinking with the budget; blocks that
    checkpoint, and runs without --compile, keep what the eager trace saw. The measured
    counterpart is tests/integration/test_plan.py's compiled row."""
    base = ["--model", "debug", "--fp32", "--seq-len", "512", "--batch-size", "4",
            "--vocab-size", "2048"]
    fractions = [compiled_block_fraction(parse_args([*base, "--compile", "--act-mem-budget",
                                                     budget])) for budget in ("1", "0.5", "0.2")]
    assert 1 > fractions[0] > fractions[1] > fractions[2] > 0, fractions
    assert compiled_block_fraction(parse_args([*base, "--compile", "--ac", "block"])) == 1
    assert compiled_block_fraction(parse_args(base)) == 1


def test_moe_candidates_search_expert_parallel_and_print_it():
    base = ["--model", "moe-debug", "--dtype", "bf16", "--seq-len", "128"]
    found = settled_candidates(base)
    assert {c.parallel.ep for c in found} == {1, 2, 4}  # dividing 4 ranks and 8 experts
    region = [c.parallel.dp_shard * c.parallel.cp * c.parallel.tp for c in found]
    assert all(r % c.parallel.ep == 0 for r, c in zip(region, found, strict=True))
    # ep spans tp and cp ranks too (etp 1), not only dp_shard ones
    assert any(c.parallel.ep > c.parallel.dp_shard for c in found)
    for c in [c for c in found if c.parallel.ep > 1][::50]:
        line = launch_line(c, 4, [*base, "--ep", "8"])
        back = parse_args(line.split(" loom train ", 1)[1].split())
        assert back.parallel == c.parallel, line


def test_accumulating_candidates_search_when_to_reduce_and_the_estimate_counts_it():
    """Under --grad-accum-steps both --accum-reduce values are searched (not under --pp,
    whose schedule reduces after each run) and printed; reducing every micro-batch moves
    that many times the gradient bytes, and every micro-batch gathers the weights."""
    base = ["--model", "debug", "--fp32", "--seq-len", "128", "--grad-accum-steps", "4"]
    found = settled_candidates(base)
    assert {c.train.accum_reduce for c in found if c.parallel.pp == 1} == {"step", "micro-batch"}
    assert {c.train.accum_reduce for c in found if c.parallel.pp > 1} == {"step"}
    for c in [c for c in found if c.parallel.pp == 1][::40]:
        line = launch_line(c, 4, [*base, "--accum-reduce", "step"])
        back = parse_args(line.split(" loom train ", 1)[1].split())
        assert back.train == c.train, line
    step = parse_args([*base[:-2], "--dp-shard", "4"])
    every = parse_args([*base, "--dp-shard", "4", "--accum-reduce", "micro-batch"])
    dims = ParallelDims.from_config(step.parallel, 4)
    one, _ = comm_seconds(step, dims, "cpu")
    deferred, _ = comm_seconds(parse_args([*base, "--dp-shard", "4"]), dims, "cpu")
    each, _ = comm_seconds(every, dims, "cpu")
    # fp32 weights gathered twice a micro-batch (8 bytes), gradients reduced once (4) or 4x
    assert deferred == pytest.approx(one * (4 * 8 + 4) / 12)
    assert each == pytest.approx(one * 4)


def test_extrapolation_grows_activations_by_at_most_one_block_each():
    """A phase whose activations differ between the traces by more than a block saves (its
    position moved, or a unit's buffers were still held) grows by what a block saves; one
    that shrank does not shrink further; static state grows linearly."""
    low = {"Activation": 10, "OptState": 4, "Temp": 7}
    high = {"Activation": 110, "OptState": 6, "Temp": 5}
    out = extrapolate(low, high, 1, 9, block_saves=3)
    assert out["Activation"] + out["Block Activation"] == 10 + 8 * 3
    assert out["Block Activation"] == 9 * 3
    assert out["OptState"] == 4 + 8 * 2 and out["Temp"] == 7
    shrank = extrapolate({"Activation": 10}, {"Activation": 8}, 1, 9, block_saves=3)
    assert shrank["Activation"] + shrank["Block Activation"] == 10


def test_a_compiled_doc_mask_run_on_an_accelerator_is_traced_without_the_dense_mask():
    """The flex block mask replaces the dense one only where a run would build it: compiled,
    on an accelerator, at cp 1, for a family that takes it."""
    argv = ["--model", "debug", "--doc-mask", "--compile"]
    assert not planned_doc_mask(parse_args(argv), "h100")
    assert planned_doc_mask(parse_args(argv), "cpu")
    assert planned_doc_mask(parse_args(argv[:-1]), "h100")
    assert planned_doc_mask(parse_args([*argv, "--cp", "2"]), "h100")
    assert not planned_doc_mask(parse_args(argv[:-2]), "cpu")  # no --doc-mask: none traced


@pytest.mark.parametrize("model", ["moe-debug", "deepseek-v3-debug"])
def test_routed_models_flops_extrapolate_to_the_whole_models_count(model: str) -> None:
    """The plan counts two shallow copies and extrapolates per block; for routed models the
    grouped matmuls' top-k rows and the dense leading blocks must come out as the whole
    model's count (it used 6 x active parameters + attention: deepseek-v3 17.8 % low, its
    latent attention wider than dim)."""
    cfg = parse_args(["--model", model, "--seq-len", "64", "--n-layers", "7"])
    assert traced_depths(cfg)[1] < 7
    whole = count_step_flops(lambda: plain_model(cfg), 1, 64)
    assert whole.exact
    assert _flops_per_sample(cfg.model, 64) == pytest.approx(whole.flops, rel=1e-9)

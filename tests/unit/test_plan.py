"""`loom plan --search` helpers: the search space and the launch lines it prints."""

from loom.config import parse_args
from loom.mesh import ParallelDims
from loom.plan.search import candidates, launch_line, unsearched


def test_unsearched_drops_the_flags_the_search_sets():
    argv = ["--model", "debug", "--tp", "2", "--ac=block", "--compile", "--fp32",
            "--batch-size", "4", "--seq-len", "128"]
    assert unsearched(argv) == ["--model", "debug", "--fp32", "--seq-len", "128"]


def test_candidates_are_valid_and_their_launch_lines_parse_back():
    cfg = parse_args(["--model", "debug", "--fp32", "--seq-len", "128"])
    found = candidates(cfg, 4)
    layouts = {(c.parallel.tp, c.parallel.dp_replicate) for c in found}
    assert layouts == {(1, 1), (1, 2), (2, 1), (2, 2)}, layouts  # debug: 2 kv heads, no tp 4
    assert {c.loss.loss_impl for c in found} == {"fused-linear"}
    assert {c.parallel.activation_checkpoint for c in found} == {"none", "selective", "block"}
    for c in found[:: max(1, len(found) // 25)]:
        line = launch_line(c, 4, ["--model", "debug", "--fp32", "--seq-len", "128"])
        argv = line.split(" loom train ", 1)[1].split()
        back = parse_args(argv)
        assert back.parallel == c.parallel and back.loss == c.loss, line
        assert back.train.batch_size == c.train.batch_size, line
        ParallelDims.from_config(back.parallel, 4)

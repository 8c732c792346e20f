"""`loom eval --tasks` end to end, offline: local lm-evaluation-harness task YAMLs over JSONL
files written here, scored on a tiny trained checkpoint through loom's `LM` wrapper, agree
with the harness's own `--model hf` on the `loom export` folder (0.5%), and the rolling
log-likelihood of a text equals `loom eval`'s loss times its tokens; bad input is one line
on stderr and exit 2."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loom.commands import eval as eval_command
from loom.hf import export
from tests.compare import column
from tests.harness import REPO, run_ranks

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("loom_logger_restored")

WORDS = ["river", "stone", "light", "the", "of", "a", "green", "house", "sea", "and",
         "quiet", "north", "wind", "over"]
EOT = "<|endoftext|>"
RTOL = 5e-3
"""The acceptance bound: loom's wrapper and the harness's HF model on the same weights."""
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

CHOICE_TASK = """task: pick
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ROLLING_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
"""


def loom(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin",
                               "LOOM_CACHE_DIR": str(cwd / "cache"), **OFFLINE})


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def train_flags(root: Path) -> list[str]:
    return ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
            "--multiple-of", "32", "--max-seq-len", "128", "--fp32", "--dataset",
            str(root / "train.jsonl"), "--seq-len", "32", "--batch-size", "4", "--max-steps",
            "4", "--lr", "3e-3", "--checkpoint-interval", "4"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint trained 4 steps, its export, and a folder of three local tasks."""
    root = tmp_path_factory.mktemp("lmeval")
    rng = random.Random(5)
    (root / "train.jsonl").write_text("".join(
        json.dumps({"text": sentence(rng, rng.randint(10, 40))}) + "\n" for _ in range(120)))
    (root / "pick.jsonl").write_text("".join(json.dumps(
        {"context": sentence(rng, 6), "answer": " " + sentence(rng, 2)}) + "\n"
        for _ in range(8)))
    (root / "texts.jsonl").write_text("".join(
        json.dumps({"text": sentence(rng, rng.randint(20, 90))}) + "\n" for _ in range(5)))
    passage = sentence(rng, 60)
    (root / "passage.jsonl").write_text(json.dumps({"text": passage + EOT}) + "\n")
    (root / "passage-doc.jsonl").write_text(json.dumps({"text": EOT + passage}) + "\n")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "pick.yaml").write_text(CHOICE_TASK.format(data=root / "pick.jsonl"))
    (tasks / "texts.yaml").write_text(ROLLING_TASK.format(name="texts",
                                                          data=root / "texts.jsonl"))
    (tasks / "passage.yaml").write_text(ROLLING_TASK.format(name="passage",
                                                            data=root / "passage.jsonl"))
    proc = loom("train", *train_flags(root), "--outdir", str(root / "run"), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = root / "run" / "checkpoints" / "step-4"
    assert export.main([str(checkpoint), str(root / "hf")]) == 0
    return {"root": root, "checkpoint": checkpoint, "hf": root / "hf", "tasks": tasks}


def loom_tasks(world: dict[str, Path], tasks: str, capsys, monkeypatch) -> dict:
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    results = world["checkpoint"].parent.parent / "eval"
    before = set(results.iterdir()) if results.is_dir() else set()
    code = eval_command.main([str(world["checkpoint"]), "--tasks", tasks, "--tasks-include",
                              str(world["tasks"])])
    out, err = capsys.readouterr()
    assert code == 0, out
    assert out.startswith("{"), out[:500]
    record = json.loads(out)  # stdout carries the results and nothing else
    written = Path(err.strip().splitlines()[-1].removeprefix("written to "))
    assert written.parent == results and written not in before, (written, before)
    assert json.loads(written.read_text()) == record  # a new file: none replaced
    return record


def harness_hf(world: dict[str, Path], tasks: list[str]) -> dict:
    """The harness's own Hugging Face model on the exported folder."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(world["tasks"]), include_defaults=False)
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(world["hf"]),
                                                          "device": "cpu", "dtype": "float32"},
                                  tasks=tasks, task_manager=manager, log_samples=False,
                                  bootstrap_iters=0)
    return out["results"]


def test_tasks_match_the_harness_on_the_export(world, capsys, monkeypatch) -> None:
    record = loom_tasks(world, "pick,texts", capsys, monkeypatch)
    assert record["step"] == 4
    reference = harness_hf(world, ["pick", "texts"])
    compared = {("pick", "perplexity"), ("pick", "acc"), ("texts", "bits_per_byte"),
                ("texts", "word_perplexity")}
    for task, metric in compared:
        ours = record["metrics"][f"eval/{task}/{metric}"]
        want = reference[task][f"{metric},none"]
        assert ours == pytest.approx(want, rel=RTOL, abs=1e-9), (task, metric, ours, want)


@pytest.mark.slow  # a `loom eval` subprocess; the harness comparison above stays default
def test_rolling_loglikelihood_is_minus_loom_eval_loss_times_tokens(world, capsys,
                                                                    monkeypatch) -> None:
    """loom eval packs "<eot> passage" with an end-of-text after it and scores every token
    after the first: the passage given end-of-text, then end-of-text; the task's text
    "passage<eot>" is scored by the harness from end-of-text on: the same tokens."""
    record = loom_tasks(world, "passage", capsys, monkeypatch)
    text = json.loads((world["root"] / "passage.jsonl").read_text())["text"]
    loglikelihood = -record["metrics"]["eval/passage/bits_per_byte"] * math.log(2) * len(
        text.encode())
    proc = loom("eval", str(world["checkpoint"]), "--dataset",
                str(world["root"] / "passage-doc.jsonl"), "--seq-len", "127", "--batch-size",
                "1", "--fp32", cwd=world["root"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads((world["root"] / "run" / "eval-step-4" / "eval.json").read_text())
    assert scored["val/tokens"] > 60
    assert loglikelihood == pytest.approx(-scored["val/loss"] * scored["val/tokens"],
                                          rel=1e-4)


@pytest.mark.slow  # a second training run
def test_tasks_during_training_are_rows_and_match_loom_eval_tasks(world, capsys,
                                                                  monkeypatch) -> None:
    """--eval-tasks-every 2 over 4 steps: rows and files at steps 2 and 4 only, the last
    equal to `loom eval --tasks` on the final checkpoint, and training itself unchanged
    (the harness leaves the run's random generators alone)."""
    root, run = world["root"], world["root"] / "periodic"
    proc = loom("train", *train_flags(root), "--eval-tasks", "texts", "--eval-tasks-every", "2",
                "--eval-tasks-include", str(world["tasks"]), "--outdir", str(run), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = column(run, "eval/texts/bits_per_byte")
    assert sorted(rows) == [2, 4], rows
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["tasks-step-2.json",
                                                                "tasks-step-4.json"]
    assert rows[2] != rows[4]  # the model changed in between
    final = loom_tasks({**world, "checkpoint": run / "checkpoints" / "step-4"}, "texts",
                       capsys, monkeypatch)
    assert rows[4] == pytest.approx(final["metrics"]["eval/texts/bits_per_byte"], rel=1e-5)
    assert column(run, "train/loss") == column(root / "run", "train/loss")


@pytest.mark.parametrize("argv, says", [
    pytest.param(["--tasks", "no_such_task_xyz", "--tasks-include", "{tasks}"],
                 "unknown lm-evaluation", marks=pytest.mark.slow),  # indexes ~15,000 tasks
    (["--tasks", "pick", "--tasks-include", "{root}/missing"], "no such file or folder"),
    (["--tasks", ","], "name at least one task"),
])
def test_bad_task_input_is_one_line_and_exit_2(world, capsys, monkeypatch, argv, says) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    argv = [a.format(root=world["root"], tasks=world["tasks"]) for a in argv]
    code = eval_command.main([str(world["checkpoint"]), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and not out and says in err and len(err.strip().splitlines()) == 1, err


def test_missing_harness_is_one_line_and_exit_2(world, capsys, monkeypatch) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else found(name, *a))
    capsys.readouterr()
    code = eval_command.main([str(world["checkpoint"]), "--tasks", "pick"])
    out, err = capsys.readouterr()
    assert code == 2 and not out and "pip install 'loom[eval]'" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.multirank
def test_every_rank_reports_bad_task_input(world) -> None:
    job = run_ranks(2, ["-m", "loom", "eval", str(world["checkpoint"]), "--tasks", "pick",
                        "--tasks-include", str(world["root"] / "missing")], timeout=240,
                    env={"LOOM_CACHE_DIR": str(world["root"] / "cache"), **OFFLINE})
    for rank in job.ranks:
        assert rank.returncode == 2, job.describe()
        assert rank.stderr.strip().splitlines() == [
            f"error: --eval-tasks-include {world['root'] / 'missing'}: no such file or "
            "folder"], job.describe()

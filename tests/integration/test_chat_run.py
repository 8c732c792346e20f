"""A chat fine-tune of the tiny model end to end: it trains with validation on held-out
conversations, its loss counts the assistant's tokens only (`labels/valid`), `loom eval`
scores its checkpoint on the chat data and `loom generate --chat` answers. A tiny Hugging
Face model folder fine-tunes on the same data with its tokenizer's own template, imported
natively and through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.hf_models import save_tiny_model

QUESTIONS = [("What is 2 + 2?", "4."), ("Name a primary color.", "Red."),
             ("Say hello.", "Hello!")]


def write_chat(data: Path) -> None:
    with data.open("w") as f:
        for i in range(30):
            q, a = QUESTIONS[i % 3]
            row = {"prompt": q, "completion": a} if i % 2 else {"messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                {"role": "assistant", "content": a}]}
            f.write(json.dumps(row) + "\n")


def test_chat_fine_tune_trains_evaluates_and_answers(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    write_chat(data)
    env = {"HF_HUB_OFFLINE": "1"}
    run = tmp_path / "run"
    train = ["--model", "debug", "--fp32", "--seq-len", "32", "--batch-size", "2"]
    job = run_ranks(1, ["-m", "loom", "train", *train, "--dataset", str(data), "--max-steps",
                        "2", "--val-fraction", "0.2", "--checkpoint-interval", "2",
                        "--outdir", str(run)], timeout=600, env=env)
    assert job.ok, job.describe()
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["doc_mask"] is True, "chat data packs with the document mask"
    rows = [json.loads(line) for line in (run / "metrics-0.jsonl").read_text().splitlines()]
    valid = [r["labels/valid"] for r in rows if "labels/valid" in r]
    tokens_per_step = 2 * 32
    assert valid and all(0 < v < tokens_per_step // 2 for v in valid), valid  # answers only
    assert any("val/loss" in r for r in rows), "validation ran on held-out conversations"

    step = run / "checkpoints" / "step-2"
    scored = run_ranks(1, ["-m", "loom", "eval", str(step), *train, "--dataset", str(data)],
                       timeout=600, env=env)
    assert scored.ok and "val/loss" in scored.ranks[0].stdout, scored.describe()
    out = run_ranks(1, ["-m", "loom", "generate", str(step), "--chat", "--prompt",
                        "Say hello.", "--max-new-tokens", "4"], timeout=300, env=env)
    assert out.ok and out.ranks[0].stdout.strip(), out.describe()


def test_mtp_fine_tunes_on_chat_data(tmp_path: Path) -> None:
    """DeepSeek-V3 with an MTP module on chat data: the data turns the document mask on
    (settled before the model runs), and the depths are scored against the answer-masked
    labels, so the run trains and logs a finite `mtp/loss` (the mask itself:
    tests/unit/test_deepseek_v3.py::test_mtp_honours_the_answer_mask)."""
    data = tmp_path / "chat.jsonl"
    write_chat(data)
    run = tmp_path / "run"
    job = run_ranks(1, ["-m", "loom", "train", "--model", "deepseek-v3-mtp-debug", "--fp32",
                        "--seq-len", "32", "--batch-size", "2", "--dataset", str(data),
                        "--max-steps", "2", "--outdir", str(run)], timeout=600,
                    env={"HF_HUB_OFFLINE": "1"})
    assert job.ok, job.describe()
    assert json.loads((run / "config.json").read_text())["data"]["doc_mask"] is True
    rows = [json.loads(line) for line in (run / "metrics-0.jsonl").read_text().splitlines()]
    mtp = [r["mtp/loss"] for r in rows if "mtp/loss" in r]
    assert mtp and all(0 < loss < 20 for loss in mtp), mtp


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_hugging_face_model_fine_tunes_with_its_tokenizers_template(tmp_path: Path,
                                                                      impl: str) -> None:
    """A tiny Hugging Face Llama folder, imported natively (a loom family: the document
    mask applies) or run as transformers' module (packed without it, with a warning); the
    folder's tokenizer template renders the conversations either way."""
    folder = save_tiny_model(tmp_path / "llama", "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}"
                               "\n{% endfor %}{% if add_generation_prompt %}### assistant: "
                               "{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "chat.jsonl"
    write_chat(data)
    run = tmp_path / "run"
    job = run_ranks(1, ["-m", "loom", "train", "--model", str(folder), "--model-impl", impl,
                        "--dataset", str(data), "--fp32", "--seq-len", "32", "--batch-size",
                        "2", "--max-steps", "2", "--outdir", str(run)], timeout=600,
                    env={"HF_HUB_OFFLINE": "1"})
    assert job.ok, job.describe()
    warned = "packed without --doc-mask" in job.ranks[0].stdout + job.ranks[0].stderr
    config = json.loads((run / "config.json").read_text())
    assert (warned, config["data"]["doc_mask"]) == (impl == "transformers", impl == "native")
    rows = [json.loads(line) for line in (run / "metrics-0.jsonl").read_text().splitlines()]
    assert all(0 < r["labels/valid"] < 32 for r in rows if "labels/valid" in r), rows

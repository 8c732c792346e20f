"""Chat data: the labels of a packed conversation are its assistant tokens (and the
end-of-text after a final answer) and nothing else, checked against a mask written out by
hand from the shipped template; a bad conversation is one line naming file and line, and
`loom train` then exits 2 leaving nothing behind."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loom.config import ConfigError, JobConfig, parse_args
from loom.config.resolved import applied
from loom.data.chat import ChatTokens, encode_chat
from loom.data.loaders import build_datasets
from loom.data.tokenizers import load_shipped_tokenizer, load_tokenizer, save_tokenizer
from loom.losses import IGNORE_INDEX
from tests.harness import run_ranks


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_labels_are_the_assistant_tokens_only(tmp_path: Path) -> None:
    tok = load_shipped_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "Bye"},
                          {"role": "assistant", "content": "See you."}]},
            {"prompt": "2+2?", "completion": "4"}]
    corpus = encode_chat((write_jsonl(tmp_path / "c.jsonl", rows),), tok, "c.jsonl")
    # The shipped template's text, piece by piece: (text, trained).
    pieces = [("<|user|>\nHi there\n<|assistant|>\n", False), ("Hello!\n", True),
              ("<|user|>\nBye\n<|assistant|>\n", False), ("See you.\n", True)]
    pieces2 = [("<|user|>\n2+2?\n<|assistant|>\n", False), ("4\n", True)]
    ids, trained = [], []
    for conv in (pieces, pieces2):
        for text, mine in conv:
            piece = tok.encode([text])[0]
            ids += piece
            trained += [mine] * len(piece)
        ids.append(tok.eot_id)
        trained.append(True)  # the final answer's end: the model learns to stop
    seq_len = len(ids) - 1
    sample = ChatTokens(corpus, tok.eot_id, seq_len)[0]
    expected = torch.tensor([t if m else IGNORE_INDEX
                             for t, m in zip(ids, trained, strict=True)])[1:]
    assert sample["input"].tolist() == ids[:-1]
    assert sample["labels"].tolist() == expected.tolist()
    assert (sample["labels"] != IGNORE_INDEX).sum() < len(ids) // 2  # prompts are not trained


GOOD = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
BAD_LINES = {  # id: (second line, message after "<file>: line 2 ")
    "not-json": ('{"messages": [', "is not JSON"),
    "no-messages": ({"text": "hello"}, "has no 'messages' list nor 'prompt' and 'completion'"),
    "empty-conversation": ({"messages": []}, "is an empty conversation"),
    "no-assistant-tokens": ({"messages": [{"role": "user", "content": "hi"}]},
                            "the chat template renders no assistant tokens"),
    "bad-message": ({"messages": [{"role": "user"}]}, "message 1 is not an object with"),
}


@pytest.mark.parametrize(("line", "message"), list(BAD_LINES.values()), ids=list(BAD_LINES))
def test_bad_conversation_is_one_line_naming_file_and_line(tmp_path, line, message):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, line, GOOD])
    with pytest.raises(ConfigError) as caught:
        encode_chat((data,), load_shipped_tokenizer(), str(data))
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{data}: line 2") and message in text, text


def test_a_bad_conversation_leaves_nothing_behind(tmp_path: Path) -> None:
    """In its own process: the claimed run folder is removed when the process exits."""
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": []}])
    job = run_ranks(1, ["-m", "loom", "train", "--model", "debug", "--dataset", str(data),
                        "--max-steps", "1", "--fp32", "--seq-len", "16", "--outdir",
                        str(tmp_path / "run")], timeout=300)
    rank = job.ranks[0]
    assert rank.returncode == 2 and rank.stderr.strip().splitlines() == [
        f"error: {data}: line 2 is an empty conversation"], job.describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


def test_a_template_reaching_python_internals_is_refused(tmp_path: Path) -> None:
    """The sandbox stops a template from walking to Python objects: one line, no code run."""
    tok = replace(load_shipped_tokenizer(),
                  chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(ConfigError, match=r"line 1 cannot be rendered by the chat template"):
        encode_chat((data,), tok, str(data))


def test_a_tokenizer_folder_brings_its_own_template(tmp_path: Path) -> None:
    """AutoTokenizer's `chat_template` is the one used (here the shipped tokenizer saved as
    a Hugging Face folder, as `loom export` writes it, with a template of its own)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    save_tokenizer(None, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                               "{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    corpus = encode_chat((write_jsonl(tmp_path / "c.jsonl", [GOOD]),), tok, "c.jsonl")
    trained = corpus.ids[corpus.trained].tolist()
    assert trained[-1] == tok.eot_id and tok.decode(trained[:-1]) == "[assistant] b\n"


def chat_config(data: Path, *flags: str) -> JobConfig:
    return parse_args(["--model", "debug", "--dataset", str(data), "--seq-len", "16",
                       "--max-steps", "1", *flags])


def test_chat_data_holds_out_whole_conversations_and_turns_the_mask_on(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 8)
    train, sets, facts = build_datasets(chat_config(data, "--val-fraction", "0.25"), 0)
    cfg = applied(chat_config(data, "--val-fraction", "0.25"), facts)
    val = sets[""]  # the default set
    assert (train.n_conversations, val.n_conversations) == (6, 2)
    assert train.n_tokens + val.n_tokens == 8 * (train.n_tokens // 6)
    assert cfg.data.doc_mask and not chat_config(data).data.doc_mask


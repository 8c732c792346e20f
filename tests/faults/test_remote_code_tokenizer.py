"""A tokenizer folder that ships code (`auto_map`) is refused in one line without
--trust-remote-code, whether stdin is closed or open (a piped `yes` answers no prompt),
and its code never runs."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.data import tokenizers
from loom.data.tokenizers import SHIPPED_TOKENIZER, load_tokenizer
from tests.faults.test_checkpoint_trust import CACHE
from tests.harness import REPO, free_port, rank_env


def code_shipping_tokenizer(folder: Path, marker: Path, where: str) -> Path:
    """A working GPT-2 tokenizer folder whose `where` file names `evil.py`, which touches
    `marker` when imported."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(
        gzip.decompress((SHIPPED_TOKENIZER / "tokenizer.json.gz").read_bytes()))
    config = json.loads((SHIPPED_TOKENIZER / "tokenizer_config.json").read_text())
    auto_map = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    if where == "tokenizer_config.json":
        config["auto_map"] = auto_map
    else:
        (folder / where).write_text(json.dumps({"model_type": "gpt2", "auto_map": auto_map}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import PreTrainedTokenizerFast as "
                                    "EvilTokenizer\n")
    return folder


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_an_auto_map_is_refused_before_transformers_is_asked(tmp_path: Path,
                                                             where: str) -> None:
    marker = tmp_path / "ran"
    folder = code_shipping_tokenizer(tmp_path / "tok", marker, where)
    with pytest.raises(ConfigError, match=f"--tokenizer-name {folder}: {where} names code of "
                                          "its own \\(auto_map\\); pass --trust-remote-code"):
        load_tokenizer(str(folder))
    assert not marker.exists()


def test_transformers_is_told_not_to_trust_even_past_loom_s_own_check(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """With loom's check out of the way, transformers gets trust_remote_code=False (never
    None, which prompts on an open stdin): it refuses the folder's code, or loads the
    tokenizer with its own classes, but never runs the code."""
    marker = tmp_path / "ran"
    folder = code_shipping_tokenizer(tmp_path / "tok", marker, "tokenizer_config.json")
    seen = []
    monkeypatch.setattr(tokenizers, "check_remote_code", lambda *args: None)
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "unset"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    try:
        load_tokenizer(str(folder))
    except ConfigError as e:
        assert "pass --trust-remote-code if you trust" in str(e), e
    assert seen == [False] and not marker.exists()


def test_a_malformed_tokenizer_config_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="tokenizer_config.json is unreadable"):
        load_tokenizer(str(folder))


@pytest.mark.multirank
@pytest.mark.parametrize("stdin", ["closed", "yes"])
@pytest.mark.parametrize("command", ["train", "tokenize"])
def test_no_prompt_and_no_code_whatever_stdin(tmp_path: Path, stdin: str, command: str
                                              ) -> None:
    marker = tmp_path / "ran"
    folder = code_shipping_tokenizer(tmp_path / "tok", marker, "tokenizer_config.json")
    text = tmp_path / "corpus.txt"
    text.write_text("hello world, a few words to tokenize.\n" * 50)
    argv = (["train", "--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
             "--n-kv-heads", "1", "--seq-len", "16", "--fp32", "--max-steps", "1",
             "--dataset", str(text), "--tokenizer-name", str(folder), "--outdir",
             str(tmp_path / "run")] if command == "train" else
            ["tokenize", str(text), str(tmp_path / "shards"), "--tokenizer-name", str(folder)])
    proc = subprocess.run([sys.executable, "-m", "loom", *argv], cwd=REPO, text=True,
                          env=rank_env(0, 1, free_port(), CACHE), capture_output=True,
                          timeout=150, **({"stdin": subprocess.DEVNULL} if stdin == "closed"
                                          else {"input": "y\n" * 1000}))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "names code of its own (auto_map); pass --trust-remote-code" \
        in lines[0], proc.stderr
    assert not marker.exists(), "the tokenizer folder's code ran"

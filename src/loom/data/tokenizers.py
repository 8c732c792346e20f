"""Tokenizers: the shipped GPT-2 one, read with the light `tokenizers` library (no
`transformers` import on the default path), and anything `transformers.AutoTokenizer` loads
(hub ids, local folders)."""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from loom.config import ConfigError
from loom.data.cache import files_fingerprint
from loom.data.hub import ensure_hub_reachable, looks_like_hub_id
from loom.safe_io import json_depth, read_json_capped

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED_TOKENIZER = ASSETS / "gpt2-tokenizer"
SHIPPED_NAME = "gpt2 (embedded)"
SHIPPED_FLAG = "gpt2-embedded"
"""--tokenizer-name of the shipped tokenizer (its file is gzipped, so it is no HF folder)."""


@dataclass(frozen=True)
class TextTokenizer:
    """What packing needs from a tokenizer, whichever library loaded it."""

    name: str
    backend: Any
    """A `tokenizers.Tokenizer`, or a `transformers` tokenizer without a Rust backend."""
    size: int
    """len(tokenizer): the base vocabulary plus added special tokens (embedding rows)."""
    eot_id: int
    pad_id: int | None
    """A pad id distinct from end-of-text, else None (masking it would hide real EOTs)."""
    chat_template: str | None = None
    """The Jinja chat template (tokenizer_config.json's `chat_template`), if any."""
    bos_token: str = ""
    eos_token: str = ""
    """Special tokens' text, which chat templates may insert."""

    @property
    def parallel(self) -> bool:
        """Rust tokenizers encode a batch on all cores by themselves."""
        return isinstance(self.backend, tokenizers.Tokenizer)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if isinstance(self.backend, tokenizers.Tokenizer):
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.backend(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)


def tokenizer_name(tokenizer: str | None, model: str | None) -> str | None:
    """--tokenizer-name, else the repo of an HF --model, else None (the shipped one)."""
    if tokenizer == SHIPPED_FLAG:
        return None
    if tokenizer is not None:
        return tokenizer
    return model if model is not None and "/" in model else None


def tokenizer_identity(name: str | None) -> str:
    """Cache-key identity without loading anything (a warm start never parses a tokenizer)."""
    if name is None:
        return f"embedded:{files_fingerprint(sorted(SHIPPED_TOKENIZER.iterdir()))}"
    path = Path(name).expanduser()
    if path.is_dir():
        return f"folder:{path.resolve()}:{files_fingerprint(sorted(path.iterdir()))}"
    return f"hub:{name}"


def save_tokenizer(name: str | None, outdir: Path, trust_remote_code: bool = False) -> None:
    """Write a tokenizer as a Hugging Face tokenizer folder (AutoTokenizer loads it)."""
    if name is None:
        text = gzip.decompress((SHIPPED_TOKENIZER / "tokenizer.json.gz").read_bytes())
        (outdir / "tokenizer.json").write_bytes(text)
        shutil.copyfile(SHIPPED_TOKENIZER / "tokenizer_config.json",
                        outdir / "tokenizer_config.json")
        return
    from transformers import AutoTokenizer

    check_remote_code(name, trust_remote_code)
    AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code
                                  ).save_pretrained(str(outdir))


def load_tokenizer(name: str | None, trust_remote_code: bool = False) -> TextTokenizer:
    """The shipped tokenizer (None) or AutoTokenizer's; code a tokenizer folder ships runs
    only with `trust_remote_code` (--trust-remote-code)."""
    return load_shipped_tokenizer() if name is None else \
        load_auto_tokenizer(name, trust_remote_code)


MAX_TOKENIZER_DEPTH = 32
"""How deeply a tokenizer.json may nest (a real one: about 6, a Sequence of normalizers)."""


def check_tokenizer_file(name: str, folder: Path) -> None:
    """A folder's tokenizer.json read as data before transformers parses it: its reader
    takes any JSON, so another schema (no `model` object, no `added_tokens` list) ended in
    a KeyError, and 100,000 nested lists in a RecursionError, each a traceback."""
    try:
        data = read_json_capped(folder / "tokenizer.json")
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer-name {name}: tokenizer.json is unreadable ({e})"
                          ) from None
    problem = "is not a JSON object" if not isinstance(data, dict) else \
        f"nests more than {MAX_TOKENIZER_DEPTH} deep" \
        if json_depth(data, MAX_TOKENIZER_DEPTH) > MAX_TOKENIZER_DEPTH else \
        "has no `model` object" if not isinstance(data.get("model"), dict) else \
        "has no `added_tokens` list" if not isinstance(data.get("added_tokens"), list) else ""
    if problem:
        raise ConfigError(f"--tokenizer-name {name}: tokenizer.json {problem} (not a "
                          "Hugging Face tokenizer file)")


REMOTE_CODE_FILES = ("tokenizer_config.json", "config.json")
"""Where a Hugging Face folder declares code of its own (`auto_map`)."""


def check_remote_code(name: str, trust_remote_code: bool) -> None:
    """A local tokenizer folder that ships code is refused in one line without
    --trust-remote-code. transformers is also always given `trust_remote_code` explicitly:
    left unset, it asks "run this code? [y/N]" on an open stdin, and a piped `yes` would
    run the folder's Python."""
    path = Path(name).expanduser()
    if trust_remote_code or not path.is_dir():
        return
    for file in REMOTE_CODE_FILES:
        try:
            config = read_json_capped(path / file)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer-name {name}: {file} is unreadable ({e})") from None
        if isinstance(config, dict) and "auto_map" in config:
            raise ConfigError(f"--tokenizer-name {name}: {file} names code of its own "
                              "(auto_map); pass --trust-remote-code if you trust it")


def load_shipped_tokenizer() -> TextTokenizer:
    text = gzip.decompress((SHIPPED_TOKENIZER / "tokenizer.json.gz").read_bytes()).decode()
    config = json.loads((SHIPPED_TOKENIZER / "tokenizer_config.json").read_text())
    backend = tokenizers.Tokenizer.from_str(text)
    return TextTokenizer(SHIPPED_NAME, backend, backend.get_vocab_size(with_added_tokens=True),
                         backend.token_to_id(config["eos_token"]), pad_id=None,
                         chat_template=config.get("chat_template"),
                         bos_token=config["bos_token"], eos_token=config["eos_token"])


def load_auto_tokenizer(name: str, trust_remote_code: bool = False) -> TextTokenizer:
    """A hub id or local folder through AutoTokenizer; encodes with its Rust backend if any."""
    hint, path = "pass a local tokenizer folder instead", Path(name).expanduser()
    if looks_like_hub_id(name, bare_ok=True):
        ensure_hub_reachable(name, "model", "--tokenizer-name", hint)
    elif not path.is_dir():
        raise ConfigError(f"--tokenizer-name {name}: no such folder, and not a hub id")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--tokenizer-name needs transformers: pip install 'loom[hf]'") from None
    check_remote_code(name, trust_remote_code)
    if path.is_dir():
        check_tokenizer_file(name, path)
        hint = "it needs a Hugging Face tokenizer's files (tokenizer.json or the slow one's)"
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name,
                                            trust_remote_code=trust_remote_code)
    except Exception as e:  # a file of another shape: the Rust reader raises Exception
        reason = " ".join(str(e).split()).rstrip(": ")  # whole, on one line
        if not isinstance(e, OSError | ValueError):
            reason = f"{type(e).__name__}: {reason}"
        if "trust_remote_code" in reason:
            hint = "pass --trust-remote-code if you trust the code it ships"
        raise ConfigError(f"--tokenizer-name {name}: cannot load it ({reason}); "
                          f"{hint}") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"--tokenizer-name {name} has no end-of-text (eos) token to "
                          "separate documents")
    pad = tok.pad_token_id
    backend = getattr(tok, "backend_tokenizer", None) or tok
    template = getattr(tok, "chat_template", None)
    return TextTokenizer(name, backend, len(tok), tok.eos_token_id,
                         None if pad == tok.eos_token_id else pad,
                         chat_template=template if isinstance(template, str) else None,
                         bos_token=str(tok.bos_token or ""), eos_token=str(tok.eos_token))

"""Chat fine-tuning data: JSONL conversations rendered with the tokenizer's chat template,
packed into windows whose labels count the assistant's tokens only.

A line holds `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"prompt": ..., "completion": ...}` (one user turn, one assistant turn). The template is
Jinja, rendered in a sandbox (no attribute access to Python internals, no code run), as
transformers renders `chat_template`. Which characters are the assistant's is found by
rendering the conversation turn by turn: the text an assistant turn adds after the prompt
that asks for it (`add_generation_prompt`) is trained on, everything else is context. Each
conversation ends with end-of-text (trained when the last turn is the assistant's, so the
model learns to stop), so `--doc-mask`, which such data always trains with, keeps every
conversation to itself.

Conversations are read and tokenized in memory on every rank (no cache): chat sets are
small next to pretraining corpora.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loom.config import ConfigError
from loom.data.compressed import open_binary
from loom.data.text import TextSource, TokenWindows, mask_labels
from loom.data.tokenizers import TextTokenizer

ENCODE_BATCH = 256
"""Conversations whose pieces are encoded in one tokenizer call."""

Messages = list[dict[str, str]]
Segments = list[tuple[str, bool]]
"""A rendered conversation as (text, is the assistant's) pieces, in order."""


class BadConversation(ConfigError):
    """A line that is no conversation; the caller adds the file and line."""


def is_chat_source(source: TextSource) -> bool:
    """Local JSONL whose first non-blank line has `messages` or `prompt`: chat data."""
    if source.kind != "local" or source.builder != "json":
        return False
    stream, raw = open_binary(str(source.files[0]))
    with raw, stream:
        for line in stream:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return False  # the text reader names the line
                return isinstance(row, dict) and ("messages" in row or "prompt" in row)
    return False


def conversation(row: Any) -> Messages:
    """The messages of one parsed line; BadConversation says what is wrong."""
    if not isinstance(row, dict):
        raise BadConversation(f"is a JSON {type(row).__name__}, not an object")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list):
            raise BadConversation("has a 'messages' field that is not a list")
    elif "prompt" in row and "completion" in row:
        messages = [{"role": "user", "content": row["prompt"]},
                    {"role": "assistant", "content": row["completion"]}]
    else:
        raise BadConversation(f"has no 'messages' list nor 'prompt' and 'completion' "
                              f"(fields: {', '.join(list(row)[:10])})")
    if not messages:
        raise BadConversation("is an empty conversation")
    for i, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise BadConversation(f"message {i} is not an object with 'role' and 'content' "
                                  "strings")
    return messages


def read_conversations(path: Path) -> Iterator[tuple[int, Messages]]:
    """(line number, messages) of every non-blank line of a JSONL file."""
    stream, raw = open_binary(str(path))
    with raw, stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                try:
                    row = json.loads(line)
                except ValueError:
                    raise BadConversation("is not JSON") from None
                yield number, conversation(row)
            except BadConversation as e:
                raise ConfigError(f"{path}: line {number:,} {e}") from None


class ChatTemplate:
    """A Jinja chat template in a sandboxed environment, with the variables transformers
    passes (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`)."""

    def __init__(self, source: str, tokenizer: TextTokenizer):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self.template = env.from_string(source)
        self.tokens = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}

    @staticmethod
    def _raise(message: str) -> None:
        raise TemplateError(message)

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.tokens)
        except TemplateError as e:
            raise BadConversation(f"cannot be rendered by the chat template ({e})") from None

    def segments(self, messages: Messages) -> Segments:
        """The conversation's text as (piece, is the assistant's) pairs, found by rendering
        it turn by turn; a template whose renderings do not extend each other is refused."""
        pieces: Segments = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[:i + 1])
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise BadConversation("is rendered by the chat template in a way that does "
                                      "not extend turn by turn (assistant tokens cannot be "
                                      "told apart)")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        whole = self.render(messages)
        if not whole.startswith(done):
            raise BadConversation("is rendered by the chat template in a way that does not "
                                  "extend turn by turn")
        pieces.append((whole[len(done):], False))
        return [(text, mine) for text, mine in pieces if text]


@dataclass
class ChatCorpus:
    """Every conversation's tokens, end-of-text after each, and which are trained on."""

    ids: np.ndarray
    trained: np.ndarray
    """bool per token: an assistant's token (or the end-of-text after a final answer)."""
    ends: list[int]
    """Token offset after each conversation, in order."""


def template_of(tokenizer: TextTokenizer, user: str) -> ChatTemplate:
    """The tokenizer's chat template, which `user` (what needs it, for the error) renders."""
    if not tokenizer.chat_template:
        raise ConfigError(f"{user} needs a chat template but tokenizer {tokenizer.name} has "
                          "none (chat_template in its tokenizer_config.json)")
    try:
        return ChatTemplate(tokenizer.chat_template, tokenizer)
    except TemplateError as e:
        raise ConfigError(f"the chat template of tokenizer {tokenizer.name} is not valid "
                          f"Jinja ({e})") from None


def encode_chat(files: tuple[Path, ...], tokenizer: TextTokenizer, dataset: str,
                ) -> ChatCorpus:
    """Every conversation of the files rendered and tokenized, in file and line order; a
    conversation with nothing to train on is a ConfigError naming its file and line."""
    template = template_of(tokenizer, f"--dataset {dataset} (conversations)")
    ids: list[np.ndarray] = []
    trained: list[np.ndarray] = []
    ends: list[int] = []
    total = 0
    batch: list[tuple[Path, int, Segments]] = []

    def flush() -> None:
        nonlocal total
        texts = [text for _, _, segments in batch for text, _ in segments]
        encoded = iter(tokenizer.encode(texts))
        for path, number, segments in batch:
            conv_ids, conv_trained = [], []
            for _, mine in segments:
                piece = next(encoded)
                conv_ids += piece
                conv_trained += [mine] * len(piece)
            if not any(conv_trained):
                raise ConfigError(f"{path}: line {number:,}: the chat template renders no "
                                  "assistant tokens (no assistant message, or an empty one)")
            conv_trained.append(segments[-1][1] or not segments[-1][0].strip()
                                if segments else False)
            conv_ids.append(tokenizer.eot_id)
            ids.append(np.asarray(conv_ids, dtype=np.int64))
            trained.append(np.asarray(conv_trained, dtype=bool))
            total += len(conv_ids)
            ends.append(total)
        batch.clear()

    for path in files:
        for number, messages in read_conversations(path):
            try:
                segments = template.segments(messages)
            except BadConversation as e:
                raise ConfigError(f"{path}: line {number:,} {e}") from None
            batch.append((path, number, segments))
            if len(batch) >= ENCODE_BATCH:
                flush()
    flush()
    if not ends:
        raise ConfigError(f"--dataset {dataset}: no conversations")
    return ChatCorpus(np.concatenate(ids), np.concatenate(trained), ends)


class ChatTokens(TokenWindows):
    """Consecutive windows of seq_len + 1 tokens over conversations [first, last) of a chat
    corpus: input = w[:-1], labels = w[1:] where the label is an assistant token, else
    ignored. The tail shorter than a window is padded with end-of-text and ignored.
    `for_evaluation()`: windows overlapping by one, so no assistant token goes unscored."""

    def __init__(self, corpus: ChatCorpus, eot_id: int, seq_len: int,
                 conversations: tuple[int, int] | None = None):
        first, last = conversations or (0, len(corpus.ends))
        self.start = corpus.ends[first - 1] if first else 0
        end = corpus.ends[last - 1]
        self.ids, self.trained = corpus.ids[self.start:end], corpus.trained[self.start:end]
        self.eot_id, self.seq_len = eot_id, seq_len
        self.n_tokens, self.n_conversations = end - self.start, last - first
        self.stride = seq_len + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        width = self.seq_len + 1
        first, last = self.span(index)
        window = torch.full((width,), self.eot_id, dtype=torch.int64)
        trained = torch.zeros(width, dtype=torch.bool)
        window[:last - first] = torch.from_numpy(self.ids[first:last])
        trained[:last - first] = torch.from_numpy(self.trained[first:last])
        return {"input": window[:-1], "labels": mask_labels(window[1:], trained[1:], None)}


def held_out(corpus: ChatCorpus, fraction: float) -> int:
    """The first held-out conversation of --val-fraction: the tail's whole conversations,
    at least one, and at least one left to train on."""
    n = len(corpus.ends)
    if n < 2:
        raise ConfigError("--val-fraction needs at least two conversations")
    return n - min(n - 1, max(1, round(n * fraction)))


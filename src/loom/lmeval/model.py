"""loom's model as an lm-evaluation-harness `LM`: any model loom can run (a checkpoint in one
process, or the training model at a periodic evaluation), under the run's own tokenizer.

Scoring follows the harness's own Hugging Face model (`--model hf`), so the numbers of the
two agree on an exported folder: a context's trailing spaces move to the continuation, the
continuation is the tail of the encoded pair, an empty context is the end-of-text token, and
rolling log-likelihood predicts every token of a text once, the first after end-of-text, in
windows of the model's context that keep the most context for each prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM

from loom.data.tokenizers import TextTokenizer

Logits = Callable[[torch.Tensor], torch.Tensor]
"""Token ids (B, T) -> logits (B, T, V)."""

Scored = tuple[list[int], int]
"""A sequence (at most `context` + 1 tokens) and how many of its last tokens are scored,
each given the tokens before it."""

DEFAULT_GEN_TOKENS = 256
"""The harness's own default for `max_gen_toks`."""


class LoomLM(LM):
    """Scores requests with `logits_of` in batches of up to `batch_size` sequences (right
    padding: a causal model's positions never see the pad after them)."""

    def __init__(self, logits_of: Logits, tokenizer: TextTokenizer, context: int,
                 device: torch.device, batch_size: int = 8):
        super().__init__()
        self.logits_of, self.tok, self.context = logits_of, tokenizer, context
        self._device, self.batch_size = device, max(1, batch_size)

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def encode(self, text: str) -> list[int]:
        return self.tok.encode([text])[0]

    def split_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the harness's HF model cuts them: the pair is
        encoded whole (a word's token may span the join), the continuation is its tail."""
        spaces = len(context) - len(context.rstrip())
        if spaces:  # " word" is one token, so the space belongs to the continuation
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tok.eot_id], self.encode(continuation)
        whole, head = self.encode(context + continuation), self.encode(context)
        return whole[:len(head)], whole[len(head):]

    def logprobs(self, items: Sequence[Scored]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each item, in order: the log-probabilities before each scored token (n, V)
        and those tokens (n,)."""
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # alike lengths
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = max(len(items[i][0]) for i in chunk) - 1
            ids = torch.full((len(chunk), width), self.tok.eot_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(items[i][0]) - 1] = torch.tensor(items[i][0][:-1])
            with torch.no_grad():
                out = F.log_softmax(self.logits_of(ids.to(self._device)).float(), dim=-1).cpu()
            for row, i in enumerate(chunk):
                seq, n = items[i]
                end = len(seq) - 1  # the position that predicts the last token
                results[i] = out[row, end - n:end], torch.tensor(seq[-n:])
        return [results[i] for i in range(len(items))]

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
        items = []
        for request in requests:
            head, tail = self.split_pair(*request.args)
            if not tail:
                raise ValueError(f"a continuation encodes to no token: {request.args[1]!r}")
            seq = (head + tail)[-(self.context + 1):]  # the context is cut from the left
            items.append((seq, min(len(tail), len(seq) - 1)))
        scored = []
        for logprobs, tokens in self.logprobs(items):
            picked = logprobs.gather(1, tokens[:, None]).sum().item()
            scored.append((picked, bool((logprobs.argmax(-1) == tokens).all())))
        return scored

    def rolling_windows(self, ids: list[int]) -> list[Scored]:
        """Every token of `ids` scored once after end-of-text: windows of `context` new
        tokens each, the last one with as much context before it as fits."""
        stream = [self.tok.eot_id, *ids]
        windows = []
        for first in range(1, len(stream), self.context):
            last = min(first + self.context, len(stream))  # one past the scored tokens
            start = max(0, last - 1 - self.context)
            windows.append((stream[start:last], last - first))
        return windows

    def loglikelihood_rolling(self, requests: list) -> list[float]:
        per_text = [self.rolling_windows(self.encode(r.args[0])) for r in requests]
        flat = self.logprobs([w for windows in per_text for w in windows])
        sums, at = [], 0
        for windows in per_text:
            parts = flat[at:at + len(windows)]
            at += len(windows)
            sums.append(sum(lp.gather(1, t[:, None]).sum().item() for lp, t in parts))
        return sums

    def generate_until(self, requests: list) -> list[str]:
        """Greedy continuations, each cut at the first of its `until` strings (no KV cache:
        each new token runs the window again)."""
        return [self.greedy(context, dict(kwargs or {})) for context, kwargs in
                (r.args for r in requests)]

    def greedy(self, context: str, kwargs: dict) -> str:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        steps = int(kwargs.get("max_gen_toks", DEFAULT_GEN_TOKENS))
        ids = self.encode(context) or [self.tok.eot_id]
        new: list[int] = []
        text = ""
        for _ in range(steps):
            window = torch.tensor([(ids + new)[-self.context:]], device=self._device)
            with torch.no_grad():
                token = int(self.logits_of(window)[0, -1].argmax())
            if token == self.tok.eot_id:
                break
            new.append(token)
            text = self.tok.decode(new)
            if any(stop in text for stop in until):
                break
        cuts = [text.index(stop) for stop in until if stop in text]
        return text[:min(cuts)] if cuts else text

"""`loom generate CHECKPOINT --prompt TEXT`: continue a prompt with a trained model, in one
process, so a user can see what training produced.

A loom checkpoint is read through `loom.hf.run_checkpoint.load_run_model` (DCP with loom's
pickle-free reader); a Hugging Face folder (e.g. from `loom export`) through transformers.
Greedy by default; --temperature and --top-k sample. No KV cache: each new token runs the
whole window again, which is fine for the short samples this is meant for.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.data.chat import template_of
from loom.data.tokenizers import TextTokenizer, load_tokenizer
from loom.hf.run_checkpoint import load_run_model, run_tokenizer
from loom.models.transformers.model import load_hf_model

Logits = Callable[[torch.Tensor], torch.Tensor]
"""Token ids (1, T) -> logits (1, T, V)."""


def load_model(path: Path, trust_remote_code: bool = False
               ) -> tuple[nn.Module, int, str | None]:
    """(model in eval mode, context length, tokenizer recorded by the run or None)."""
    if (path / "loop.json").is_file():
        with warnings.catch_warnings():  # its note that it loads in one process: by design
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            model, held = load_run_model(path)
        tokenizer = run_tokenizer(path)
        context = (held.args.max_seq_len if held.spec.name != "transformers"
                   else model.hf.config.max_position_embeddings)
        return model.eval(), context, tokenizer
    if (path / "config.json").is_file():
        model = load_hf_model(ModelConfig(model=str(path.resolve()),
                                          trust_remote_code=trust_remote_code))
        has_tokenizer = (path / "tokenizer_config.json").is_file()
        return model.eval(), model.hf.config.max_position_embeddings, \
            str(path) if has_tokenizer else None
    raise ConfigError(f"loom generate: {path} is neither a loom checkpoint (loop.json) nor "
                      "a Hugging Face model folder (config.json)")


@torch.no_grad()
def sample(logits_of: Logits, ids: list[int], max_new_tokens: int, *, context: int,
           temperature: float = 0.0, top_k: int = 0, seed: int = 0,
           stop: int | None = None) -> list[int]:
    """The prompt ids followed by `max_new_tokens` new ones, or fewer ending with `stop`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = logits_of(tokens[:, -context:])[:, -1, :].float()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt], dim=1)
        if stop is not None and nxt.item() == stop:
            break
    return tokens[0].tolist()


def generate(path: Path, prompt: str, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, tokenizer_name: str | None = None,
             trust_remote_code: bool = False, chat: bool = False) -> str:
    """The prompt and its continuation, as text; with `chat`, the prompt is a user turn
    rendered through the tokenizer's chat template and only the answer is returned (up to
    end-of-text, which a chat fine-tune learns to emit after an answer)."""
    model, context, recorded = load_model(path, trust_remote_code)
    tokenizer: TextTokenizer = load_tokenizer(tokenizer_name or recorded, trust_remote_code)
    check_vocab(model, tokenizer, path)
    if chat:
        template = template_of(tokenizer, "loom generate --chat")
        text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        text = prompt
    ids = tokenizer.encode([text])[0] or [tokenizer.eot_id]
    out = sample(model, ids, max_new_tokens, context=context, temperature=temperature,
                 top_k=top_k, seed=seed, stop=tokenizer.eot_id if chat else None)
    if not chat:
        return tokenizer.decode(out)
    answer = out[len(ids):]
    text = tokenizer.decode(answer[:-1] if answer[-1:] == [tokenizer.eot_id] else answer)
    return text.strip()  # a template's turn ends in a line break, print adds one


@torch.no_grad()
def check_vocab(model: nn.Module, tokenizer: TextTokenizer, path: Path) -> None:
    """A tokenizer larger than the model's vocabulary would index past its embedding (a
    model trained on random tokens records the default tokenizer it never used)."""
    width = model(torch.zeros(1, 1, dtype=torch.long)).size(-1)
    if tokenizer.size > width:
        raise ConfigError(f"loom generate: {path} has a vocabulary of {width} tokens but "
                          f"tokenizer {tokenizer.name} has {tokenizer.size}; pass the "
                          "--tokenizer-name the model was trained with")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom generate",
                                     description="continue a prompt with a trained model")
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder or an "
                        "exported Hugging Face folder")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--chat", action="store_true", help="answer --prompt as a user turn "
                        "of the tokenizer's chat template; print the answer only")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely "
                        "tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-name", "--tokenizer_name", default=None,
                        help="default: the run's tokenizer (or the shipped GPT-2)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code a Hugging Face folder or tokenizer ships")
    parser.add_argument("--verbose", action="store_true", help="show upstream notices")
    opts = parser.parse_args(list(argv))
    try:
        if opts.max_new_tokens < 0 or opts.top_k < 0 or opts.temperature < 0:
            raise ConfigError("--max-new-tokens, --top-k and --temperature must be >= 0")
        print(generate(opts.checkpoint, opts.prompt, opts.max_new_tokens,
                       temperature=opts.temperature, top_k=opts.top_k, seed=opts.seed,
                       tokenizer_name=opts.tokenizer_name,
                       trust_remote_code=opts.trust_remote_code, chat=opts.chat))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        print(f"error: loom generate failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0

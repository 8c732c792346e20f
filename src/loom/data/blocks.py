"""Cutting one long document into fragments that tokenize exactly as the whole would.

A tokenizer's pre-tokenizer splits text into words before BPE merges anything, so a cut
where it splits anyway changes no token. Which places qualify depends on the tokenizer
(GPT-2's regex keeps a space with the word after it and splits the last blank off a run
of them; a SentencePiece-style normalizer prepends a space to every input), so a candidate
cut (after a lone line break, else before a space between words) is checked with the
tokenizer itself: the text around it must encode to the same tokens whole and cut. A
candidate that fails is simply not used; a document with no usable cut within
`MAX_BLOCKS` blocks is refused rather than cut wrongly.

Fragments are short (FRAGMENT_CHARS) because a Rust tokenizer encodes a few thousand
characters ~1.5x faster per character than a megabyte, and holds ~200 bytes per character
of its input while encoding it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

CONTEXT = 64
"""Characters each side of a candidate cut that are encoded to check it (pre-tokenizers
look at most a character or two past a word)."""
FRAGMENT_CHARS = 4096
"""Target fragment length: the cuts are looked for this far apart."""
MAX_BLOCKS = 64
"""A document with no usable cut in this many blocks is an error (memory would grow)."""

Encode = Callable[[list[str]], list[list[int]]]


class NoSafeCut(ValueError):
    """No place in `MAX_BLOCKS` blocks where this tokenizer can cut without changing tokens."""


def candidate(text: str, lo: int, hi: int) -> int | None:
    """The position in (lo, hi] nearest `hi` after a lone line break between two non-blank
    characters, else at a space between two words (the space goes with the word after it)."""
    for sep, after in (("\n", 1), (" ", 0)):
        pos = hi
        while (found := text.rfind(sep, lo + 1, pos)) >= 0:
            pos = found
            if found + 1 < len(text) and not (text[found - 1].isspace()
                                              or text[found + 1].isspace()):
                return found + after
    return None


def safe_cuts(text: str, step: int, encode: Encode) -> list[int]:
    """Checked cuts about `step` apart in (0, len(text) - CONTEXT], ascending, found with
    one tokenizer call: around each, the text encodes the same whole and cut."""
    cuts = []
    for target in range(step, len(text) - CONTEXT + 1, step):
        cut = candidate(text, max(target - step // 2, cuts[-1] if cuts else 0), target)
        if cut is not None:
            cuts.append(cut)
    if not cuts:
        return []
    windows = [(text[max(0, c - CONTEXT):c], text[c:c + CONTEXT]) for c in cuts]
    ids = encode([s for left, right in windows for s in (left + right, left, right)])
    return [c for i, c in enumerate(cuts) if ids[3 * i] == ids[3 * i + 1] + ids[3 * i + 2]]


def fragments(chunks: Iterable[str], block_chars: int, encode: Encode) -> Iterator[str]:
    """Re-cut one document, given as chunks of any size, into fragments of about
    FRAGMENT_CHARS characters (less for a smaller `block_chars`) whose encodings
    concatenate to the whole document's; about `block_chars` plus a chunk are held at once."""
    buffer, step = "", min(FRAGMENT_CHARS, max(block_chars // 2, 1))
    for chunk in chunks:
        buffer += chunk
        if len(buffer) < block_chars + CONTEXT:
            continue
        cuts = safe_cuts(buffer, step, encode)
        if not cuts:
            if len(buffer) > MAX_BLOCKS * block_chars:
                raise NoSafeCut(f"no place to cut a document into blocks within "
                                f"{len(buffer):,} characters without changing its tokens")
            continue
        for a, b in zip([0, *cuts], cuts, strict=False):
            yield buffer[a:b]
        buffer = buffer[cuts[-1]:]
    if buffer:
        yield buffer

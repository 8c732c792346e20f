"""`loom digest CHECKPOINT [--expect SHA256]`: the checkpoint's cryptographic digest, to
publish next to a shared checkpoint and to compare before using a downloaded one.

The manifest's xxh3-64 hashes detect accidents (a flipped bit, a truncated copy) and are
checked on every load, but they authenticate nothing: whoever edits a file can recompute
them and reseal the manifest. The digest is a SHA-256 over the SHA-256 of every file the
manifest lists and of the manifest itself (the `--files` listing, in sha256sum's format),
computed here from the files as they are, after each has matched the manifest's size and
xxh3. Equal digests mean byte-equal checkpoints, once the expected one comes from someone
trusted. Nothing is hashed at save time, so saving costs what it did.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

from loom.checkpoint.trust import (
    MANIFEST,
    SECURE_HASH,
    UnusableCheckpoint,
    file_record,
    read_manifest,
)
from loom.config import ConfigError


def file_digests(path: Path) -> list[tuple[str, str]]:
    """(SHA-256, name) of the manifest and of every file it lists, by name; each file must
    match the manifest's size and xxh3."""
    manifest = read_manifest(path)
    found = []
    for name in sorted([*manifest["files"], MANIFEST]):
        try:
            actual = file_record(path / name, secure=True)
        except FileNotFoundError:
            raise UnusableCheckpoint(f"checkpoint {path}: {name} is missing") from None
        except (OSError, ValueError) as e:
            raise UnusableCheckpoint(f"checkpoint {path}: {name} is unusable ({e})") from None
        expected = manifest["files"].get(name)
        if expected is not None and (actual["bytes"], actual["xxh3"]) != \
                (expected["bytes"], expected["xxh3"]):
            raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} does not match "
                                     f"{MANIFEST}")
        found.append((actual[SECURE_HASH], name))
    return found


def listing(files: list[tuple[str, str]]) -> str:
    return "".join(f"{sha}  {name}\n" for sha, name in files)


def files_digest(paths: list[Path]) -> str:
    """The SHA-256 of the files' listing, as `checkpoint_digest` computes a checkpoint's,
    for files no manifest lists (the base folder a LoRA run reads): equal to
    `sha256sum NAMES | sha256sum` run in their folder, the names in byte order."""
    files = [(file_record(p, secure=True)[SECURE_HASH], p.name)
             for p in sorted(paths, key=lambda p: p.name.encode())]
    return hashlib.sha256(listing(files).encode()).hexdigest()


def checkpoint_digest(path: Path) -> tuple[str, list[tuple[str, str]]]:
    """The checkpoint's digest (SHA-256 of the listing) and the listing's entries."""
    files = file_digests(path)
    return hashlib.sha256(listing(files).encode()).hexdigest(), files


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom digest",
                                     description="print a checkpoint's SHA-256 digest")
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder")
    parser.add_argument("--expect", metavar="SHA256", help="exit 2 unless the digest is this "
                        "(with or without the sha256: prefix)")
    parser.add_argument("--files", action="store_true", help="first list each file's SHA-256 "
                        "(sha256sum's format: the digest is the SHA-256 of these lines)")
    opts = parser.parse_args(list(argv))
    try:
        digest, files = checkpoint_digest(opts.checkpoint)
        expected = (opts.expect or "").strip().lower().removeprefix("sha256:")
        if opts.expect is not None and expected != digest:
            raise ConfigError(f"checkpoint {opts.checkpoint} has digest sha256:{digest}, not "
                              f"the expected sha256:{expected}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.files:
        print(listing(files), end="")
    print(f"sha256:{digest}  {opts.checkpoint}")
    return 0

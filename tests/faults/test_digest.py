"""`loom digest`: a SHA-256 over every file of a checkpoint and its manifest, which a
resealed (tampered) checkpoint cannot keep, computed from the files as they are."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from loom.checkpoint.digest import checkpoint_digest, main
from loom.checkpoint.trust import UnusableCheckpoint
from tests.faults.test_checkpoint_trust import TINY, copy_run, flip_a_byte, loom, reseal


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("digest") / "run"
    proc = loom("train", *TINY, "--max-steps", "1", "--checkpoint-interval", "1",
                "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


def test_the_digest_is_the_sha256_of_sha256sum_lines(run: Path) -> None:
    checkpoint = run / "checkpoints" / "step-1"
    digest, files = checkpoint_digest(checkpoint)
    names = sorted(p.name for p in checkpoint.iterdir())
    assert [name for _, name in files] == names
    lines = "".join(f"{hashlib.sha256((checkpoint / n).read_bytes()).hexdigest()}  {n}\n"
                    for n in names)
    assert digest == hashlib.sha256(lines.encode()).hexdigest()


@pytest.mark.parametrize("tamper", ["loop.json", "__0_0.distcp", "manifest-run-id"])
def test_a_resealed_tampering_changes_the_digest(run: Path, tmp_path: Path, tamper: str,
                                                 capsys) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-1"
    published, _ = checkpoint_digest(checkpoint)
    if tamper == "manifest-run-id":
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["run_id"] = "someone-else"
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    else:
        if tamper == "loop.json":
            loop = json.loads((checkpoint / "loop.json").read_text())
            loop["settings"]["lr"] = 1.0
            (checkpoint / "loop.json").write_text(json.dumps(loop))
        else:
            flip_a_byte(checkpoint / tamper)
        reseal(checkpoint)  # the xxh3 seal no longer notices
    tampered, _ = checkpoint_digest(checkpoint)
    assert tampered != published
    assert main([str(checkpoint), "--expect", f"sha256:{published}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: checkpoint {checkpoint} has digest sha256:{tampered}, not the "
                   f"expected sha256:{published}\n")


def test_expect_accepts_the_printed_digest(run: Path, capsys) -> None:
    checkpoint = run / "checkpoints" / "step-1"
    assert main([str(checkpoint)]) == 0
    line = capsys.readouterr().out.strip()
    digest = line.split()[0]
    assert line == f"{digest}  {checkpoint}" and digest.startswith("sha256:")
    assert main([str(checkpoint), "--expect", digest.upper().replace("SHA256:", "")]) == 0


@pytest.mark.parametrize("break_it", ["missing", "fifo", "unsealed-change"])
def test_a_broken_checkpoint_has_no_digest(run: Path, tmp_path: Path, break_it: str,
                                           capsys) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-1"
    target = checkpoint / "rng-0.json"
    if break_it == "missing":
        target.unlink()
    elif break_it == "fifo":
        target.unlink()
        os.mkfifo(target)
    else:
        flip_a_byte(target)
    with pytest.raises(UnusableCheckpoint):
        checkpoint_digest(checkpoint)
    assert main([str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rng-0.json" in err, err

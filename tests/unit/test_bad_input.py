"""Every user-fixable mistake found before training is one line on stderr, exit 2, and no
run folder (checked in-process through the `loom train` and `loom launch` entry points)."""

from __future__ import annotations

import sys

import pytest

from loom.cli import run_train
from loom.runtime import launch

BASE = ["--model", "debug", "--dataset", "random", "--max-steps", "1", "--fp32"]
MISTAKES = {  # id: (flags, message)
    "lr-negative": (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    "lr-nan": (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    "multiple-of-0": (["--multiple-of", "0"], "--multiple-of must be >= 1, got 0"),
    "vocab-0": (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    "vocab-negative": (["--vocab-size", "-5"], "--vocab-size must be >= 1, got -5"),
    "hidden-dim-negative": (["--hidden-dim", "-4"], "--hidden-dim must be >= 1, got -4"),
    "epochs-0": (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    "epochs-negative": (["--epochs", "-3"], "--epochs must be >= 1, got -3"),
    "dataset-empty": (["--dataset", ""], "--dataset must not be empty"),
    "outdir-empty": (["--outdir", ""], "--outdir must not be empty"),
    "max-grad-norm-nan": (["--max-grad-norm", "nan"], "--max-grad-norm must be a number"),
    "hf-limit-negative": (["--hf-limit", "-5"], "--hf-limit must be >= 0, got -5"),
    "sigterm-grace-negative": (["--sigterm-grace-s", "-1"],
                               "--sigterm-grace-s must be >= 0, got -1.0"),
    "n-experts-negative": (["--n-experts", "-4"], "--n-experts must be >= 0, got -4"),
    "max-skipped-steps-0": (["--max-skipped-steps", "0"], "--max-skipped-steps must be >= 1"),
    "lr-not-a-number": (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    "mixture-weight": (["--dataset", "a.txt:0.5,b.txt:much"],
                       "--dataset a.txt:0.5,b.txt:much: weight 'much' of b.txt is not a number"),
    "mixture-streaming": (["--dataset", "a.txt:1,b.txt:1", "--streaming"],
                          "a --dataset mixture is of text, JSONL or shard sources"),
    "val-dataset-twice": (["--dataset", "a.txt", "--val-dataset", "x=b.txt", "--val-dataset",
                           "x=c.txt"], "--val-dataset: two sets with the name 'x'"),
    "model-impl-reason-given": (["--model-impl-reason", "checked by hand"],
                                "--model-impl-reason is loom's record of why --model-impl "
                                "resolved as it did"),
    "doc-mask-transformers": (["--doc-mask", "--model", "owner/name", "--model-impl",
                               "transformers"], "--doc-mask needs loom's own model"),
    **{f"ft-{name}": (["--ft-replica-groups", "2", *flags],
                      f"--ft-replica-groups does not run with {refused}")
       for name, flags, refused in (
           ("dp-replicate", ["--dp-replicate", "2"], "--dp-replicate 2"),
           ("streaming", ["--dataset", "a.txt", "--streaming"], "--streaming"))},
    "ft-group-alone": (["--ft-group", "1"], "--ft, --ft-group, --ft-lighthouse and "
                       "--ft-join-timeout-s ($LOOM_FT_GROUP, $LOOM_FT_LIGHTHOUSE, "
                       "$LOOM_FT_JOIN_TIMEOUT_S) need --ft-replica-groups"),
    "ft-join-timeout-alone": (["--ft-join-timeout-s", "120"], "--ft-join-timeout-s "
                              "($LOOM_FT_GROUP, $LOOM_FT_LIGHTHOUSE, $LOOM_FT_JOIN_TIMEOUT_S) "
                              "need --ft-replica-groups"),
    "ft-diloco-alone": (["--ft", "diloco"], "--ft, --ft-group, --ft-lighthouse and "
                        "--ft-join-timeout-s ($LOOM_FT_GROUP, $LOOM_FT_LIGHTHOUSE, "
                        "$LOOM_FT_JOIN_TIMEOUT_S) need --ft-replica-groups"),
    "sync-every-without-diloco": (["--ft-replica-groups", "2", "--sync-every", "5"],
                                  "--sync-every needs --ft diloco"),
    "outer-lr-without-diloco": (["--outer-lr", "0.5", "--outer-momentum", "0.8"],
                                "--outer-lr, --outer-momentum need --ft diloco"),
    "ft-unknown": (["--ft-replica-groups", "2", "--ft", "localsgd"],
                   "argument --ft: invalid choice: 'localsgd'"),
}

pytestmark = pytest.mark.usefixtures("loom_logger_restored")


def assert_one_line_exit_2(code: int, stderr: str, message: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, stderr)


def test_tensorboard_without_its_package_is_one_line_and_writes_nothing(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), "--tensorboard"])
    assert_one_line_exit_2(code, capsys.readouterr().err, "--tensorboard needs the tensorboard "
                           "package: pip install 'loom[tensorboard]'")
    assert list(tmp_path.iterdir()) == []


def test_ft_replica_groups_without_torchft_is_one_line_naming_the_extra(tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), "--ft-replica-groups", "2"])
    assert_one_line_exit_2(code, capsys.readouterr().err, "--ft-replica-groups needs the "
                           "torchft package: pip install 'loom[ft]'")
    assert list(tmp_path.iterdir()) == []


FT_NEEDS_TORCHFT = {  # refusals checked after the package is found: skipped without it
    "ft-no-lighthouse": (["--ft-replica-groups", "2"], "--ft-replica-groups 2 needs torchft's "
                         "lighthouse: start the job with loom launch --ft-replica-groups 2"),
    "ft-group-too-high": (["--ft-replica-groups", "2", "--ft-group", "2", "--ft-lighthouse",
                           "http://127.0.0.1:1"], "--ft-group 2 ($LOOM_FT_GROUP) must be "
                          "below --ft-replica-groups 2"),
}


@pytest.mark.parametrize(("flags", "message"), list(FT_NEEDS_TORCHFT.values()),
                         ids=list(FT_NEEDS_TORCHFT))
def test_ft_replica_group_mistakes_are_one_line(tmp_path, capsys, flags, message):
    pytest.importorskip("torchft")
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), *flags])
    assert_one_line_exit_2(code, capsys.readouterr().err, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flags", "message"), list(MISTAKES.values()), ids=list(MISTAKES))
def test_bad_flag_is_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    outdir = ["--outdir", str(tmp_path / "run")] if "--outdir" not in flags else []
    code = run_train([*BASE, *outdir, *flags])
    assert_one_line_exit_2(code, capsys.readouterr().err, message)
    assert list(tmp_path.iterdir()) == []


def test_seq_len_environment_must_be_an_integer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SEQ_LEN", "abc")
    code = run_train([*BASE, "--outdir", str(tmp_path / "run")])
    assert_one_line_exit_2(code, capsys.readouterr().err, "SEQ_LEN must be an integer, got 'abc'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["is-a-file", "under-a-file", "unwritable"])
def test_outdir_that_cannot_be_a_run_folder(tmp_path, capsys, monkeypatch, where):
    (tmp_path / "file").write_text("keep")
    outdir = tmp_path / "file" / "run" if where == "under-a-file" else tmp_path / "file"
    if where == "unwritable":  # chmod cannot stop root, so stand in for the permission check
        outdir = tmp_path / "locked" / "run"
        (tmp_path / "locked").mkdir()
        monkeypatch.setattr("loom.runtime.preflight.os.access", lambda path, mode: False)
    code = run_train([*BASE, "--outdir", str(outdir)])
    message = "cannot write in" if where == "unwritable" else "is a file, not a folder"
    assert_one_line_exit_2(code, capsys.readouterr().err, message)
    assert (tmp_path / "file").read_text() == "keep"
    assert where == "is-a-file" or not outdir.exists()


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_launch_needs_at_least_one_rank(capsys, nproc):
    code = launch.main(["-n", nproc, "true"])
    assert_one_line_exit_2(code, capsys.readouterr().err, f"-n must be >= 1, got {nproc}")



@pytest.mark.parametrize(("argv", "env", "message"), [
    (["-n", "3", "--ft-replica-groups", "2"], {}, "--ft-replica-groups 2 does not divide -n 3"),
    (["-n", "2", "--ft-replica-groups", "0"], {}, "--ft-replica-groups must be >= 1, got 0"),
    (["-n", "4", "--ft-replica-groups", "2", "--nnodes", "2"], {},
     "--ft-replica-groups starts every group on this machine outside Slurm or PBS"),
    (["-n", "4", "--ft-replica-groups", "2", "--rdzv-endpoint", "h:1"], {},
     "--ft-replica-groups gives each group its own rendezvous: not --rdzv-endpoint"),
    (["-n", "4", "--ft-replica-groups", "2"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST":
                                               "nid[1-3]"},
     "--ft-replica-groups 2 does not divide the job's 3 nodes (each group takes whole nodes)"),
    (["-n", "4", "--ft-replica-groups", "2"], {"SLURM_JOB_ID": "7"},
     "--ft-replica-groups: the slurm job names no nodes"),
    (["-n", "4", "--ft-replica-groups", "2"], {"PBS_JOBID": "7"}, "PBS_NODEFILE is not set"),
], ids=["indivisible", "zero", "nnodes", "rdzv", "slurm-nodes", "slurm-no-nodes", "pbs"])
def test_launch_refuses_replica_groups_it_cannot_start(capsys, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = launch.main([*argv, "true"])
    assert_one_line_exit_2(code, capsys.readouterr().err, message)


def test_launch_replica_groups_without_torchft_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    code = launch.main(["-n", "2", "--ft-replica-groups", "2", "true"])
    assert_one_line_exit_2(code, capsys.readouterr().err, "--ft-replica-groups needs the "
                           "torchft package: pip install 'loom[ft]'")


def test_launch_replica_groups_dry_run_shows_lighthouse_and_groups(capsys):
    pytest.importorskip("torchft")
    code = launch.main(["-n", "4", "--ft-replica-groups", "2", "--dry-run", "loom", "train"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and "LighthouseServer" in lines[0] and len(lines) == 3, lines
    for g, line in enumerate(lines[1:]):
        assert line.startswith(f"LOOM_FT_GROUP={g} LOOM_FT_LIGHTHOUSE=ADDRESS ")
        assert line.endswith("-m loom launch -n 2 --max-restarts 0 -- loom train"), line

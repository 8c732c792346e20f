"""`loom launch` command construction, with faked scheduler environments (nothing is run)."""

import json
import os
import shlex
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from loom.runtime import launch, launch_agent, launch_commands
from loom.runtime.launch import parse_args
from loom.runtime.launch_commands import Host, expand_nodelist, omp_threads
from loom.runtime.watchdog import HANG_KEY

CPU_HOST = Host(cpus=64, accelerators=0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests may run inside a real Slurm/PBS job; start each from a neutral environment."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PBS_")) or name in ("OMP_NUM_THREADS", "MASTER_PORT"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(launch, "detect_host", lambda: CPU_HOST)
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)  # no scontrol, no CMD


def dry_run(capsys, *argv):
    assert launch.main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return out.strip()


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("nid001", ["nid001"]),
        ("a1,b2", ["a1", "b2"]),
        ("nid[001-003,007]", ["nid001", "nid002", "nid003", "nid007"]),
        ("gpu[8-10],login1", ["gpu8", "gpu9", "gpu10", "login1"]),
        ("x[1-2]-y[01-02]", ["x1-y01", "x1-y02", "x2-y01", "x2-y02"]),
        ("a[1,3],b[05]", ["a1", "a3", "b05"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_dry_run(monkeypatch, capsys):
    for name, value in {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": "64",
                        "SLURM_JOB_NODELIST": "nid[007-008]"}.items():
        monkeypatch.setenv(name, value)
    assert dry_run(capsys, "-n", "8", "loom", "train") == (
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --kill-on-bad-exit=1 --wait=10 "
        "--cpus-per-task=8 "
        "--export=ALL,MASTER_ADDR=nid007,MASTER_PORT=15001,OMP_NUM_THREADS=8 loom train"
    )


def test_slurm_counts_from_the_allocation(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_NODELIST", "g[1-3]")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    line = dry_run(capsys, "--rdzv-endpoint", "head:1234", "loom", "train")
    assert line.startswith("srun --nodes=3 --ntasks=12 --ntasks-per-node=4 "
                           "--kill-on-bad-exit=1 --wait=10 ")
    assert "--cpus-per-task" not in line and "OMP_NUM_THREADS" not in line
    assert "--export=ALL,MASTER_ADDR=head,MASTER_PORT=1234 loom train" in line
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert "--ntasks=6 --ntasks-per-node=2" in dry_run(capsys, "loom", "train")


def test_pbs_dry_run(monkeypatch, capsys, tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x3001\nx3001\nx3002\nx3002\n")
    monkeypatch.setenv("PBS_JOBID", "42.pbs")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    assert dry_run(capsys, "-n", "4", "loom", "train", "--tp", "2") == (
        f"mpiexec -n 8 --ppn 4 --hostfile {nodefile} --cpu-bind depth -d 16 "
        "--env MASTER_ADDR=x3001 --env MASTER_PORT=15042 --env OMP_NUM_THREADS=16 "
        "loom train --tp 2"
    )


def test_pbs_without_nodefile_is_an_error(monkeypatch, capsys):
    monkeypatch.setenv("PBS_JOBID", "42.pbs")
    assert launch.main(["loom", "train"]) == 2
    assert capsys.readouterr().err == "loom launch: PBS_NODEFILE is not set\n"


def test_local_dry_run(capsys):
    line = dry_run(capsys, "-n", "4", "loom", "train", "--model", "debug", "--tp", "2")
    python = shlex.quote(sys.executable)
    assert line.startswith(f"OMP_NUM_THREADS=16 {python} -m torch.distributed.run ")
    for flag in ("--nproc-per-node=4", "--max-restarts=0", "--standalone",
                 "--redirects=0:0,1:1,2:1,3:1"):
        assert flag in line.split()
    assert line.endswith(" --no-python loom train --model debug --tp 2")


def test_local_multi_node(capsys):
    line = dry_run(capsys, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29400",
                   "-n", "1", "loom", "train")
    for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=h0:29400", "--rdzv-id=loom"):
        assert flag in line.split()
    assert "--standalone" not in line and "--redirects" not in line
    assert launch.main(["--nnodes", "2", "loom", "train"]) == 2
    assert "needs --rdzv-endpoint" in capsys.readouterr().err


def test_omp_threads():
    assert omp_threads({}, CPU_HOST, 4) == {"OMP_NUM_THREADS": "16"}
    assert omp_threads({}, CPU_HOST, 128) == {"OMP_NUM_THREADS": "1"}
    assert omp_threads({}, CPU_HOST, 4, cpus=8) == {"OMP_NUM_THREADS": "2"}
    assert omp_threads({"OMP_NUM_THREADS": "3"}, CPU_HOST, 4) == {}
    assert omp_threads({}, Host(cpus=64, accelerators=4), 4) == {}


def test_everything_after_the_options_is_the_command():
    assert parse_args(["-n", "4", "loom", "train", "-n", "3"]).cmd == ["loom", "train", "-n", "3"]
    assert parse_args(["--", "loom", "--", "x"]).cmd == ["loom", "--", "x"]


@pytest.mark.parametrize("argv", [[], ["-n", "2"], ["--dry-run", "--"]])
def test_no_command(capsys, argv):
    assert launch.main(argv) == 2
    assert capsys.readouterr().err == "loom launch: no command given\n"


def test_unknown_program_fails_before_starting_ranks(capsys):
    assert launch.main(["-n", "2", "no-such-program"]) == 127
    assert capsys.readouterr().err == "loom launch: command not found: no-such-program\n"


def test_env_assignments_are_shell_quoted():
    command = launch_commands.Command(["echo", "a b"], {"X": "1 2"})
    assert str(command) == "X='1 2' echo 'a b'"


def test_failure_is_one_line(capsys, tmp_path):
    missing = str(tmp_path / "error.json")
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file=missing),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=missing),
    }
    failures[0].timestamp = failures[1].timestamp + 1  # rank 1 failed first
    assert launch_agent._report_failure(ChildFailedError("loom", failures)) == 3
    assert capsys.readouterr().err == "loom launch: rank 1 (local 1) failed with exit code 3\n"


def failure(tmp_path, rank, exitcode, line=None, timestamp=100, hang=None):
    """A rank's failure as the agent sees it, with the error line the rank left (if any)
    and a watchdog's facts about a hang (if any)."""
    path = tmp_path / f"error-{rank}.json"
    if line is not None:
        data = {"message": line, "timestamp": timestamp}
        path.write_text(json.dumps({**data, HANG_KEY: hang} if hang else data))
    found = ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=exitcode,
                           error_file=str(path))
    found.timestamp = timestamp
    return found


def test_config_error_of_another_rank_is_printed_when_rank_0_was_stopped(capsys, tmp_path):
    """Rank 1 failed first and the agent stopped rank 0 before it printed (issue #20)."""
    line = "error: --n-heads 4 is not divisible by --tp 3"
    failures = {0: failure(tmp_path, 0, -15, timestamp=99), 1: failure(tmp_path, 1, 2, line)}
    assert launch_agent._report_failure(ChildFailedError("loom", failures)) == 2
    assert capsys.readouterr().err == line + "\n"


def test_config_error_already_printed_by_rank_0_is_not_repeated(capsys, tmp_path):
    line = "error: --n-heads 4 is not divisible by --tp 3"
    failures = {0: failure(tmp_path, 0, -15, line, timestamp=100),
                1: failure(tmp_path, 1, 2, line, timestamp=100)}
    assert launch_agent._report_failure(ChildFailedError("loom", failures)) == 2
    assert capsys.readouterr().err == ""


def test_summary_names_the_cause_not_the_ranks_that_lost_it(capsys, tmp_path):
    lost = "error (rank 0): lost contact with another rank: Connection reset by peer"
    failures = {0: failure(tmp_path, 0, 1, lost, timestamp=99),
                1: failure(tmp_path, 1, -9, timestamp=101)}
    assert launch_agent._report_failure(ChildFailedError("loom", failures)) == 128 + 9
    assert capsys.readouterr().err == \
        "loom launch: rank 1 (local 1) was killed by SIGKILL; 1 other rank(s) failed too\n"


def test_a_hang_is_one_line_naming_who_never_arrived_and_who_waited(capsys, tmp_path):
    def waited(rank, collective="all_gather #1559 on dp_shard (layers.3)"):
        facts = {"rank": rank, "waited_s": 20.0, "collective": collective,
                 "stalled": [[1, "host-a", "silent since step 7"]]}
        return failure(tmp_path, rank, 1, f"loom: rank {rank}: no step finished", 100 + rank,
                       facts)

    failures = {0: waited(0), 1: failure(tmp_path, 1, -9, timestamp=110), 2: waited(2),
                3: waited(3, "all_reduce #9 on world (module unknown)")}
    assert launch_agent._report_failure(ChildFailedError("loom", failures)) == 1
    assert capsys.readouterr().err == (
        "loom launch: rank 1 (host-a) never entered all_gather #1559 on dp_shard (layers.3); "
        "ranks 0,2,3 waited 20 s\n")
    failures = {0: waited(0, None), 1: failure(tmp_path, 1, -9, timestamp=110)}
    launch_agent._report_failure(ChildFailedError("loom", failures))
    assert capsys.readouterr().err == \
        "loom launch: rank 1 (host-a) stopped (silent since step 7); rank 0 waited 20 s\n"


@pytest.mark.parametrize(("job_id", "port"), [
    ("1", "15001"), ("1234567", str(15000 + 1234567 % 15000)), ("42.pbs01", "15042"),
    ("14999", "29999"), ("15000", "15000"),
])
def test_the_rendezvous_port_comes_from_the_job_id(job_id: str, port: str) -> None:
    assert launch_commands.job_port(job_id) == port


def test_neighbouring_and_array_jobs_get_different_ports() -> None:
    ports = {launch_commands.job_port(str(job)) for job in range(9000, 9100)}
    assert len(ports) == 100 and all(15000 <= int(p) < 30000 for p in ports)
    array = {launch_commands.job_port(f"77[{i}].server") for i in range(50)}
    assert len(array) == 50 and all(15000 <= int(p) < 30000 for p in array)


def test_master_port_still_overrides_the_job_port(monkeypatch, capsys) -> None:
    for name, value in {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1",
                        "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    assert "MASTER_PORT=23456" in dry_run(capsys, "loom", "train")
    monkeypatch.delenv("MASTER_PORT")
    assert "MASTER_PORT=15009" in dry_run(capsys, "loom", "train")


def slurm_allocation(monkeypatch, nodelist: str = "nid[001-004]") -> None:
    for name, value in {"SLURM_JOB_ID": "1", "SLURM_NNODES": "4", "SLURM_CPUS_ON_NODE": "8",
                        "SLURM_JOB_NODELIST": nodelist}.items():
        monkeypatch.setenv(name, value)


def test_slurm_dry_run_shows_each_retry_leaving_out_a_node(monkeypatch, capsys):
    slurm_allocation(monkeypatch)
    assert launch.main(["--dry-run", "--retries", "2", "--nnodes", "2", "-n", "1",
                        "loom", "train"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5, lines
    assert "--exclude" not in lines[0] and "MASTER_ADDR=nid001" in lines[0]
    assert lines[1] == "# retry 1 of 2, if a task on nid001 failed: it is left out"
    assert lines[2].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
                               "--exclude=nid001 --kill-on-bad-exit=1 --wait=10 ")
    assert "MASTER_ADDR=nid002" in lines[2], "the rendezvous moves off the excluded node"
    assert lines[3] == "# retry 2 of 2, if a task on nid002 failed: it is left out"
    assert "--exclude=nid001,nid002 " in lines[4] and "MASTER_ADDR=nid003" in lines[4]


def test_slurm_dry_run_retries_without_spare_nodes_repeat_the_command(monkeypatch, capsys):
    slurm_allocation(monkeypatch, "nid[001-002]")
    assert launch.main(["--dry-run", "--retries", "1", "loom", "train"]) == 0
    first, comment, retry = capsys.readouterr().out.splitlines()
    assert comment == "# retry 1 of 1, no spare node to leave out" and retry == first


def test_local_retries_repeat_the_agent_and_negative_retries_are_bad_input(capsys):
    assert launch.main(["--dry-run", "--retries", "1", "-n", "2", "loom", "train"]) == 0
    first, comment, retry = capsys.readouterr().out.splitlines()
    assert comment == "# retry 1 of 1, the same command" and retry == first
    assert launch.main(["--retries", "-1", "loom", "train"]) == 2
    err = capsys.readouterr().err
    assert err == "loom launch: --retries must be >= 0, got -1\n"


FAKE_SRUN = """#!/bin/sh
# fails with code $FAIL_CODE, naming a failed task on $FAIL_HOST, on its first $FAILS runs
echo "attempt=$LOOM_LAUNCH_ATTEMPT $*" >> "$CALLS"
n=$(wc -l < "$CALLS")
if [ "$n" -le "$FAILS" ]; then
  echo "srun: error: nid004: task 3: Terminated" >&2
  echo "srun: error: $FAIL_HOST: task 1: Exited with exit code $FAIL_CODE" >&2
  exit "$FAIL_CODE"
fi
exit 0
"""


def fake_srun(monkeypatch, tmp_path, fails: int, code: int = 1):
    """An `srun` on PATH that fails `fails` times; returns the file of its command lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"CALLS": str(calls), "FAILS": str(fails), "FAIL_CODE": str(code),
                        "FAIL_HOST": "nid002"}.items():
        monkeypatch.setenv(name, value)
    return calls


def test_a_failed_srun_runs_again_without_the_failed_node(monkeypatch, capsys, tmp_path):
    slurm_allocation(monkeypatch)
    calls = fake_srun(monkeypatch, tmp_path, fails=1)
    assert launch.main(["--retries", "2", "--nnodes", "3", "loom", "train"]) == 0
    first, second = calls.read_text().splitlines()
    assert "--exclude" not in first and "--exclude=nid002 " in second
    assert first.startswith("attempt=0 ") and second.startswith("attempt=1 "), \
        "the ranks of a retry know to resume"
    err = capsys.readouterr().err
    assert "loom launch: attempt 1 exited 1 (a task failed on nid002); retry 1 of 2, " \
        "leaving out nid002" in err, err
    assert "srun: error: nid002: task 1" in err, "srun's own lines pass through"


def test_retries_run_out_and_the_last_exit_code_is_returned(monkeypatch, capsys, tmp_path):
    slurm_allocation(monkeypatch)
    calls = fake_srun(monkeypatch, tmp_path, fails=9)
    assert launch.main(["--retries", "2", "--nnodes", "3", "loom", "train"]) == 1
    attempts = calls.read_text().splitlines()
    assert len(attempts) == 3
    assert "--exclude=nid002 " in attempts[2], "one spare node: nid002 stays left out"
    assert capsys.readouterr().err.count("loom launch: attempt") == 2


@pytest.mark.parametrize("code", [2, 143])
def test_bad_input_and_preemption_are_not_retried(monkeypatch, tmp_path, code):
    slurm_allocation(monkeypatch)
    calls = fake_srun(monkeypatch, tmp_path, fails=1, code=code)
    assert launch.main(["--retries", "2", "loom", "train"]) == code
    assert len(calls.read_text().splitlines()) == 1


def test_rdzv_conf_reaches_torchrun_on_several_nodes(capsys):
    line = dry_run(capsys, "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400",
                   "--rdzv-conf", "is_host=1", "--local-addr", "10.0.0.1", "loom", "train")
    assert "--rdzv-endpoint=10.0.0.1:29400 --rdzv-id=loom --rdzv-conf=is_host=1 " \
        "--local-addr=10.0.0.1 " in line


def ft_dry_run(capsys, *argv):
    assert launch.main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_slurm_replica_groups_take_whole_nodes_each_with_its_own_launch(monkeypatch, capsys):
    """In a Slurm job each replica group is a `loom launch` of its share of the nodes
    (retried on a failure as --max-restarts says), with its own rendezvous port; that launch
    runs srun on exactly those nodes, its rank 0 on the first."""
    pytest.importorskip("torchft")
    for name, value in {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "nid[001-004]"}.items():
        monkeypatch.setenv(name, value)
    lines = ft_dry_run(capsys, "-n", "8", "--ft-replica-groups", "2", "--max-restarts", "3",
                       "loom", "train")
    assert "LighthouseServer" in lines[0] and len(lines) == 3, lines
    groups = [shlex.split(line) for line in lines[1:]]
    for g, (nodes, port) in enumerate([("nid001,nid002", "15001"),
                                       ("nid003,nid004", "15002")]):
        env = dict(word.split("=", 1) for word in groups[g][:5])
        assert env == {"LOOM_FT_GROUP": str(g), "LOOM_FT_LIGHTHOUSE": "ADDRESS",
                       "LOOM_FT_JOIN_TIMEOUT_S": "30.0", "LOOM_LAUNCH_NODES": nodes,
                       "MASTER_PORT": port}
        assert groups[g][6:] == ["-m", "loom", "launch", "-n", "8", "--nnodes", "2",
                                 "--retries", "3", "--", "loom", "train"]
    for name, value in {"LOOM_LAUNCH_NODES": "nid003,nid004", "MASTER_PORT": "15002"}.items():
        monkeypatch.setenv(name, value)  # group 1's own launch
    assert dry_run(capsys, "-n", "8", "--nnodes", "2", "loom", "train") == (
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --nodelist=nid003,nid004 "
        "--kill-on-bad-exit=1 --wait=10 "
        "--export=ALL,MASTER_ADDR=nid003,MASTER_PORT=15002,OMP_NUM_THREADS=8 loom train")


def test_pbs_replica_groups_run_mpiexec_on_their_own_hosts(monkeypatch, capsys, tmp_path):
    pytest.importorskip("torchft")
    nodefile = tmp_path / "nodes"
    nodefile.write_text("a\na\nb\nb\nc\nc\nd\nd\n")
    for name, value in {"PBS_JOBID": "5.server", "PBS_NODEFILE": str(nodefile)}.items():
        monkeypatch.setenv(name, value)
    lines = ft_dry_run(capsys, "-n", "2", "--ft-replica-groups", "4", "loom", "train")
    assert [dict(w.split("=", 1) for w in shlex.split(line)[:5])["LOOM_LAUNCH_NODES"]
            for line in lines[1:]] == ["a", "b", "c", "d"]
    monkeypatch.setenv("LOOM_LAUNCH_NODES", "c")
    line = dry_run(capsys, "-n", "2", "--nnodes", "1", "loom", "train")
    assert line.startswith("mpiexec -n 2 --ppn 2 --hosts c --cpu-bind depth"), line
    assert "--env MASTER_ADDR=c " in line, line


def test_the_join_timeout_reaches_the_lighthouse_and_every_group(capsys):
    """--ft-join-timeout-s is the lighthouse's join timeout and each group's
    $LOOM_FT_JOIN_TIMEOUT_S (its ranks wait for a quorum longer than it); out of range, one
    line and exit 2."""
    pytest.importorskip("torchft")
    lines = ft_dry_run(capsys, "-n", "4", "--ft-replica-groups", "2", "--ft-join-timeout-s",
                       "600", "loom", "train")
    assert "join_timeout_ms=600000" in lines[0], lines
    for line in lines[1:]:
        assert "LOOM_FT_JOIN_TIMEOUT_S=600.0" in shlex.split(line), line
    for bad in ("0", "-1", "nan", "1e9"):
        assert launch.main(["--dry-run", "-n", "4", "--ft-replica-groups", "2",
                            "--ft-join-timeout-s", bad, "loom", "train"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--ft-join-timeout-s must be > 0 and <= 86400" in err[0], err


def test_the_commands_own_flags_are_not_taken_for_abbreviations(capsys):
    """`--ft diloco` after CMD is loom train's flag, though it begins two of launch's own
    (argparse would take it for an ambiguous abbreviation and stop)."""
    pytest.importorskip("torchft")
    lines = ft_dry_run(capsys, "-n", "4", "--ft-replica-groups", "2", "loom", "train",
                       "--ft", "diloco", "--ft-replica-groups", "2")
    assert all(shlex.split(line)[-5:] == ["train", "--ft", "diloco", "--ft-replica-groups", "2"]
               for line in lines[1:]), lines

"""Two `loom launch` processes, one per "node", joined by c10d rendezvous on 127.0.0.1: the
multi-node path (each node's elastic agent, the rendezvous, global ranks across agents)
run for real on one machine. Its losses must equal a one-launcher `-n 2` job's exactly:
the same two ranks, seed and collectives, only started differently. Where the test may
create network namespaces (root, `ip netns`), the two nodes also run in separate ones
joined by a veth pair, so that nothing travels through a shared loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import loom
from tests.compare import column
from tests.harness import free_port

LAUNCH = "import sys; from loom.runtime.launch import main; sys.exit(main(sys.argv[1:]))"
TRAIN = [sys.executable, "-m", "loom", "train", "--model", "debug", "--dataset", "random",
         "--vocab-size", "512", "--seq-len", "64", "--fp32", "--batch-size", "2",
         "--max-steps", "4", "--seed", "3"]


def launcher(*argv: str, prefix: tuple[str, ...] = (), **extra: str) -> subprocess.Popen:
    """`loom launch argv`, run under `prefix` (`ip netns exec NS`) with `extra` variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PBS_JOBID")}
    src = str(Path(loom.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return subprocess.Popen([*prefix, sys.executable, "-c", LAUNCH, *argv], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """Wait for every launcher (killing all if one outlives `timeout`): (exit code, stderr)."""
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.mark.multirank
def test_two_launchers_train_as_one_two_rank_job(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launcher("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "multinode-test", "-n", "1", *TRAIN,
                      "--outdir", str(tmp_path / "two-nodes"))
             for rank in (0, 1)]
    for code, err in finish(nodes):
        assert code == 0, err[-3000:]
    (code, err), = finish([launcher("-n", "2", *TRAIN, "--outdir", str(tmp_path / "one-node"))])
    assert code == 0, err[-3000:]

    two, one = column(tmp_path / "two-nodes"), column(tmp_path / "one-node")
    assert sorted(two) == [1, 2, 3, 4]
    assert two == one, f"two launchers {two} vs one launcher {one}"
    config = json.loads((tmp_path / "two-nodes" / "config.json").read_text())
    assert config["world_size"] == 2 and config["mesh"]["dp_shard"] == 2, config["mesh"]


def netns_unavailable() -> str | None:
    """Why this machine cannot run the namespaced variant (None: it can)."""
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"loom-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@contextlib.contextmanager
def two_namespaces() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: (name, address, interface) of each,
    deleted (with their veth ends) on exit."""
    tag = os.getpid() % 100000
    nodes = [(f"loom-n{i}-{tag}", f"10.213.{tag % 250}.{i + 1}", f"lv{i}-{tag}")
             for i in (0, 1)]
    try:
        for name, _, _ in nodes:
            ip("netns", "add", name)
        ip("link", "add", nodes[0][2], "type", "veth", "peer", "name", nodes[1][2])
        for name, address, interface in nodes:
            ip("link", "set", interface, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", name, "link", "set", interface, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield nodes
    finally:
        for name, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.mark.slow  # ~45 s with its one-launcher reference; the loopback case is the default
@pytest.mark.multirank
def test_two_launchers_in_separate_network_namespaces_train_as_one_job(tmp_path: Path
                                                                       ) -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"no network namespaces: {reason}")
    # torch's agent can tell neither that a veth address is its own (is_host) nor which
    # address the other node reaches it at (--local-addr); its hostname resolves to loopback
    with two_namespaces() as nodes:
        endpoint = f"{nodes[0][1]}:{free_port()}"
        launchers = [
            launcher("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                     "--rdzv-id", "netns-test", "--rdzv-conf", f"is_host={int(rank == 0)}",
                     "--local-addr", address, "-n", "1", *TRAIN,
                     "--outdir", str(tmp_path / "namespaces"),
                     prefix=("ip", "netns", "exec", name), GLOO_SOCKET_IFNAME=interface)
            for rank, (name, address, interface) in enumerate(nodes)]
        for code, err in finish(launchers, timeout=180):
            assert code == 0, err[-3000:]
    (code, err), = finish([launcher("-n", "2", *TRAIN, "--outdir", str(tmp_path / "one"))])
    assert code == 0, err[-3000:]
    apart, one = column(tmp_path / "namespaces"), column(tmp_path / "one")
    assert sorted(apart) == [1, 2, 3, 4] and apart == one, (apart, one)

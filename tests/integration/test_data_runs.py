"""Real text data end to end: distributed batches, `loom train` on local files and on the
embedded corpus, and the offline hub error."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.compare import column, rows
from tests.harness import free_port, run_ranks


def numbers(seed: int, n: int = 40) -> str:
    """Random numbers, so that no two windows of the token stream are equal."""
    rng = random.Random(seed)
    return " ".join(str(rng.randrange(10**6)) for _ in range(n))


DOCS = [f"Document {i}: {numbers(i)}" for i in range(200)]


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), path)
    return path


@pytest.mark.multirank
def test_tp_ranks_share_batches_and_dp_groups_split_one_global_order(tmp_path, parquet):
    job = run_ranks(4, ["tests/workers/data_worker.py", str(parquet), str(tmp_path)], timeout=600,
                    env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    by_dp: dict[int, list[dict]] = {}
    for record in ranks:
        by_dp.setdefault(record["dp_rank"], []).append(record)
    assert sorted(by_dp) == [0, 1] and all(len(g) == 2 for g in by_dp.values())
    for group in by_dp.values():
        for a, b in zip(group[0]["batches"], group[1]["batches"], strict=True):
            torch.testing.assert_close(a, b)
    windows = [{tuple(w.tolist()) for b in by_dp[d][0]["batches"] for w in b} for d in (0, 1)]
    assert len(windows[0]) == len(windows[1]) == 4 * 2 and not windows[0] & windows[1]
    for step, whole in enumerate(ranks[0]["one_process"]):
        parts = torch.cat([by_dp[d][0]["batches"][step] for d in (0, 1)])
        torch.testing.assert_close(parts, whole)
    assert [r["imported_datasets"] for r in ranks] == [True, False, False, False]
    assert {r["vocab_size"] for r in ranks} == {50257}


@pytest.mark.multirank
def test_loom_train_on_a_local_parquet_with_tp(tmp_path, parquet):
    flags = ["--model", "debug", "--tp", "2", "--dataset", str(parquet), "--seq-len", "32",
             "--fp32", "--max-steps", "3", "--seed", "1", "--outdir", str(tmp_path / "run")]
    job = run_ranks(4, ["-m", "loom", "train", *flags], timeout=900,
                    env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    losses = list(column(tmp_path / "run").values())
    assert len(losses) == 3 and all(0 < x < 12 for x in losses)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == 50257
    assert not any("--vocab-size" in w for w in config["warnings"]), "flag was not given"
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 1


def test_default_run_trains_on_the_embedded_corpus_offline(tmp_path):
    flags = ["--model", "debug", "--seq-len", "64", "--fp32", "--max-steps", "2",
             "--outdir", str(tmp_path / "run")]
    job = run_ranks(1, ["-m", "loom", "train", *flags], timeout=900,
                    env={"LOOM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert job.ok, job.describe()
    assert len(rows(tmp_path / "run")) == 2
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["source"] == "embedded corpus" and meta["documents"] == 2
    assert meta["n_tokens"] > 1_000_000 and meta["vocab_size"] == 50257


def fail_at_data(tmp_path: Path, dataset: str, env: dict[str, str]) -> str:
    """`loom train` on one rank that must stop with a ConfigError while building the data."""
    job = run_ranks(1, ["-m", "loom", "train", "--model", "debug", "--dataset", dataset,
                        "--outdir", str(tmp_path / "run")], timeout=300,
                    env={"LOOM_CACHE_DIR": str(tmp_path / "cache"), **env})
    (rank,) = job.ranks
    errors = [line for line in rank.stderr.splitlines() if line.strip()]
    assert rank.returncode == 2 and len(errors) == 1, job.describe()
    return errors[0]


@pytest.mark.parametrize("network", ["offline", "unreachable"])
def test_hub_dataset_without_network_is_a_one_line_error(tmp_path, network):
    """A retry loop would hit run_ranks' hang limit; benchmarks/fail_fast.py times these."""
    if network == "offline":
        env = {"HF_HUB_OFFLINE": "1"}
    else:  # a closed local port stands in for a machine without a network
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    line = fail_at_data(tmp_path, "eliplutchok/fineweb-small-sample", env)
    assert line.startswith("error: --dataset eliplutchok/fineweb-small-sample")
    assert "pass local files instead" in line

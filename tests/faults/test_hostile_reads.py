"""What loom reads from a path the user gives (`--config`, `--dataset` and its mixture
sources, `--val-dataset`, the task YAMLs of `--tasks-include`) is a regular file of bounded
size: a FIFO or a device is refused at once (never opened to block or read forever), in one
line naming the flag or the path, exit 2, and nothing is written. A task folder whose YAML
names Python runs it only with --trust-remote-code."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loom.cli import run_train
from loom.commands.eval import main as eval_main
from loom.config import ConfigError
from tests.faults.test_checkpoint_trust import TINY
from tests.faults.test_hostile_outputs import one_error_line, run, snapshot

__all__ = ["run"]  # the module's run folder fixture, shared with the outputs tests
pytestmark = pytest.mark.usefixtures("loom_logger_restored")
HANG_LIMIT_S = 30
"""Only catches a hang: each case ends in well under a second of its own work."""
TRAIN = [arg for arg in TINY if arg not in ("--dataset", "random")]


def in_time(call: Callable[[], int]) -> int:
    """`call()`'s exit code; the test fails if it has not returned within the limit."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(HANG_LIMIT_S)
    assert not worker.is_alive(), "blocked"
    return result[0]


def sparse(path: Path, size: int) -> str:
    with path.open("wb") as f:
        f.truncate(size)
    return str(path)


def fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def text(path: Path, content: str = "some text to train on\n" * 50) -> str:
    path.write_text(content)
    return str(path)


READS: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    "config-fifo": lambda t: (["--config", fifo(t / "c.toml"), "--dataset", "random"],
                              "--config"),
    "config-dev-zero": lambda t: (["--config", "/dev/zero", "--dataset", "random"],
                                  "--config /dev/zero: zero is a character device"),
    "config-folder": lambda t: (["--config", str(t), "--dataset", "random"],
                                "is a directory, not a regular file"),
    "config-oversized": lambda t: (["--config", sparse(t / "big.toml", 2 << 20),
                                    "--dataset", "random"], "more than the 1,048,576 allowed"),
    "config-missing": lambda t: (["--config", str(t / "none.toml"), "--dataset", "random"],
                                 "no such file"),
    "dataset-fifo": lambda t: (["--dataset", fifo(t / "d.txt")],
                               "--dataset " + str(t / "d.txt") + " is a FIFO"),
    "dataset-dev-zero": lambda t: (["--dataset", "/dev/zero"], "is a character device"),
    "val-dataset-fifo": lambda t: (["--dataset", text(t / "a.txt"), "--val-dataset",
                                    fifo(t / "v.txt")], "--val-dataset " + str(t / "v.txt")),
    "mixture-source-fifo": lambda t: ([
        "--dataset", f"{text(t / 'a.txt')}:1,{fifo(t / 'b.txt')}:1"], "is a FIFO"),
    "mixture-same-file": lambda t: ([
        "--dataset", f"{text(t / 'a.txt')}:1,{t}/./a.txt:1"], "a source is named twice"),
    "mixture-link-to-it": lambda t: ([
        "--dataset", f"{text(t / 'a.txt')}:1,{link(t / 'b.txt', t / 'a.txt')}:1"],
        "a source is named twice"),
    "mixture-arabic-digit": lambda t: ([
        "--dataset", f"{text(t / 'a.txt')}:\u0661,{text(t / 'b.txt')}:1"],
        "weight '\u0661' of"),
}


def link(path: Path, target: Path) -> str:
    path.symlink_to(target)
    return str(path)


@pytest.mark.parametrize("case", list(READS))
def test_a_path_that_is_no_bounded_regular_file_is_one_line(tmp_path: Path, capsys,
                                                            case: str) -> None:
    (tmp_path / "in").mkdir()
    args, message = READS[case](tmp_path / "in")
    before = snapshot(tmp_path)
    code = in_time(lambda: run_train([*TRAIN, "--max-steps", "1", *args,
                                      "--outdir", str(tmp_path / "run")]))
    one_error_line(code, capsys.readouterr().err, message)
    assert snapshot(tmp_path) == before


FUNCTION_TASK = """task: {name}
dataset_path: json
output_type: loglikelihood
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
process_docs: !function utils.grab
"""


def task_folder(root: Path, marker: Path) -> dict[str, Callable[[], tuple[Path, str]]]:
    """Each case: (the --tasks-include folder, what the refusal names)."""
    def one(name: str, body: str) -> Path:
        folder = root / name
        folder.mkdir()
        (folder / "utils.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         "def grab(docs):\n    return docs\n")
        (folder / f"{name}.yaml").write_text(body)
        return folder

    def include_outside() -> tuple[Path, str]:
        elsewhere = one("elsewhere", FUNCTION_TASK.format(name="hidden"))
        (elsewhere / "elsewhere.yaml").rename(root / "outside.yml")
        return one("inc", f"include: {root / 'outside.yml'}\ntask: inc\n"), "outside.yml"

    def fifo_yaml() -> tuple[Path, str]:
        folder = one("fifo", "task: fifo\n")
        os.mkfifo(folder / "pipe.yaml")
        return folder, "pipe.yaml is a FIFO, not a regular file"

    def oversized() -> tuple[Path, str]:
        folder = one("big", "task: big\n")
        sparse(folder / "huge.yaml", 2 << 20)
        return folder, "more than the 1,048,576 allowed"

    return {
        "function-tag": lambda: (one("fn", FUNCTION_TASK.format(name="fn")),
                                 "names Python (the tag !function)"),
        "class-key": lambda: (one("cls", "task: cls\nclass: mymodule.MyTask\n"),
                              "a Python task class (class:)"),
        "python-tag": lambda: (one("py", "task: py\nx: !!python/name:os.system\n"),
                               "the tag tag:yaml.org,2002:python/name:os.system"),
        "dataset-script": lambda: (one("ds", "task: ds\ndataset_kwargs:\n  "
                                             "trust_remote_code: true\n"),
                                   "a dataset loading script"),
        "include-outside": include_outside,
        "fifo-yaml": fifo_yaml,
        "oversized-yaml": oversized,
    }


TASK_CASES = ["function-tag", "class-key", "python-tag", "dataset-script", "include-outside",
              "fifo-yaml", "oversized-yaml"]


@pytest.mark.parametrize("case", TASK_CASES)
def test_a_task_folder_that_runs_code_or_blocks_is_one_line(run: Path, tmp_path: Path,
                                                            capsys, case: str) -> None:
    pytest.importorskip("lm_eval")
    marker = tmp_path / "code-ran"
    (tmp_path / "tasks").mkdir()
    folder, message = task_folder(tmp_path / "tasks", marker)[case]()
    before = snapshot(tmp_path)
    code = in_time(lambda: eval_main([str(run / "checkpoints" / "step-2"), "--tasks",
                                      folder.name, "--tasks-include", str(folder)]))
    line = one_error_line(code, capsys.readouterr().err, message)
    assert "--eval-tasks-include" in line and not marker.exists()
    assert snapshot(tmp_path) == before


def test_trust_remote_code_lets_a_task_folder_name_python(tmp_path: Path) -> None:
    """The opt-in admits code, never a FIFO or an oversized file."""
    pytest.importorskip("lm_eval")
    from loom.lmeval.task_files import check_task_folder

    cases = task_folder(tmp_path, tmp_path / "code-ran")
    for case in ("function-tag", "class-key", "dataset-script", "include-outside"):
        folder, _ = cases[case]()
        check_task_folder(str(folder), trust_remote_code=True)
        with pytest.raises(ConfigError, match="--trust-remote-code"):
            check_task_folder(str(folder), trust_remote_code=False)
    folder, _ = cases["fifo-yaml"]()
    with pytest.raises(ConfigError, match="is a FIFO"):
        check_task_folder(str(folder), trust_remote_code=True)
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_pbs_nodefile_that_is_no_regular_file_is_one_line(tmp_path: Path, capsys,
                                                           monkeypatch, kind: str) -> None:
    from loom.runtime import launch

    path = fifo(tmp_path / "nodes") if kind == "fifo" else "/dev/zero"
    monkeypatch.setenv("PBS_JOBID", "42.pbs")
    monkeypatch.setenv("PBS_NODEFILE", path)
    code = in_time(lambda: launch.main(["--dry-run", "loom", "train"]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"PBS_NODEFILE {path}: " in lines[0], lines
    assert "not a regular file" in lines[0] and "Traceback" not in lines[0]

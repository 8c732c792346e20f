"""A family is one unit (issues #56, #67): the files its one registration names are its own
folder (model, arguments, flags, presets, plan, adapters), so adding a family touches that
folder and one `register` line."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tests.families.gpt2
from loom.config import ConfigError, parse_args
from loom.models.registry import families
from loom.models.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "loom"


def named_files(spec: ModelSpec) -> set[str]:
    """The source files of everything the record holds: model, arguments, flags, builders,
    parallel plan, Hugging Face adapters, hooks."""
    things = [spec.model_cls, spec.args_from_config, spec.build, spec.plan, *spec.flags,
              *(type(a) for a in spec.hf), *(h.run for h in spec.hooks)]
    if spec.args_cls is not None:
        things.append(spec.args_cls)
    return {Path(inspect.getfile(inspect.unwrap(t))).resolve().relative_to(REPO).as_posix()
            for t in things if t is not None}


def test_each_family_names_its_folder():
    """loom's families name files of their own folder, their plan included (a family built
    on another's blocks, qwen3 on llama, names that family's too) and nothing else; the test
    family names its one file."""
    allowed = {"llama": {"models/llama", "models/qwen3"},
               "qwen3": {"models/llama", "models/qwen3"},
               "moe": {"models/llama", "models/qwen3", "models/moe"},
               "qwen3-moe": {"models/llama", "models/qwen3", "models/moe"},
               "deepseek-v3": {"models/llama", "models/qwen3", "models/moe",
                               "models/transformers", "models/deepseek_v3"},
               "transformers": {"models/transformers"},
               "gpt2-test": {"tests/families/gpt2.py"}}
    found = {spec.name: named_files(spec) for spec in families()}
    assert set(found) == set(allowed)
    for name, files in found.items():
        outside = {f for f in files if not any(
            f.removeprefix("src/loom/").startswith(place) for place in allowed[name])}
        assert not outside, (name, outside)
    assert found["gpt2-test"] == {"tests/families/gpt2.py"}
    assert "src/loom/models/moe/flags.py" in found["moe"]
    assert "src/loom/models/moe/plan.py" in found["moe"]


def test_loom_registers_its_families_in_one_place():
    """One `register(...)` line per family, in `loom/families.py`, and no other
    module of src/ registers one."""
    text = (SRC / "families.py").read_text()
    lines = [line for line in text.splitlines() if line.startswith("register(")]
    assert len(lines) == len([s for s in families() if s.name != "gpt2-test"]), lines
    others = [p for p in SRC.rglob("*.py") if p.name != "families.py"
              and "\nregister(" in p.read_text()]
    assert not others, others


def test_the_test_family_is_named_nowhere_in_src() -> None:
    """The test family lives in its file alone: src/ names neither the family nor any of its
    parts (its embedding, blocks, head, attention, MLP), as code or as a string."""
    spec = tests.families.gpt2.GPT2_SPEC
    parts = spec.parts
    names = {spec.name, "GPT2", parts.embedding, parts.blocks, *parts.head, parts.attention,
             *parts.feed_forward} - {None}
    hits = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) else \
                node.id if isinstance(node, ast.Name) else None
            if isinstance(named, str) and named in names - GENERIC:
                hits.append(f"{path.relative_to(REPO)}:{node.lineno} {named}")
    assert not hits, hits


GENERIC = {"blocks", "head", "attn"}
"""Words loom's own API uses for every family (`ModelPlan.blocks()`, `ModelSpec.blocks`,
`ModelParts.head`, `--hist attn`'s kind): not the test family's."""


def test_the_test_family_brings_its_presets_and_refusals() -> None:
    """Its preset selects it with every size; the layout it refuses is one line."""
    cfg = parse_args(["--model", "gpt2-test-tiny", "--dataset", "random"])
    assert cfg.model.family == "gpt2-test" and (cfg.model.dim, cfg.data.seq_len) == (64, 32)
    with pytest.raises(ConfigError, match="--cp 2: the gpt2-test family"):
        parse_args(["--model", "gpt2-test-tiny", "--dataset", "random", "--cp", "2",
                    "--dp-shard", "1"])

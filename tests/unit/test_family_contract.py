"""The model-family contract stays true: outside `loom/models/` and the family plans no code
names a family's submodules or imports a family's model module; `loom.models` never imports
`loom.parallel`; a built model names its own family; a family's hooks are its spec's; a
checkpoint's model record is checked against the family's own arguments dataclass."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest

import loom
import loom.parallel.expert
import tests.families.gpt2  # noqa: F401  (registers gpt2-test)
from loom.checkpoint.model_record import RecordError, check_record, upgrade
from loom.checkpoint.resume import architecture, check_architecture
from loom.config import ConfigError, parse_args
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.registry import for_model
from loom.models.resolve import model_args, plain_model
from loom.protocols import extensions

SRC = Path(loom.__file__).parent
FAMILIES = sorted(p.name for p in (SRC / "models").iterdir()
                  if p.is_dir() and (p / "spec.py").exists())
"""loom's family folders (`models/<family>/`, each with its spec)."""
HUB_LOADER = "transformers"
"""transformers' module is a family and also the Hub loading the Hugging Face interop
(`loom.hf`, `generate`, the model resolver) builds on: importing it is allowed."""
REGISTRATION = "families.py"
"""The one module outside the folders that names them: loom's registration list."""
SUBMODULES = {"tok_embeddings", "layers", "output", "attention", "moe", "feed_forward",
              "attention_norm", "ffn_norm"}
"""Attribute names of loom's families' parts (Llama's and MoE's)."""
NOT_A_MODEL = {("output", "cfg"), ("output", "flags"), ("output", "self.cfg"),
               ("attention", "plan"), ("attention", "parts"), ("feed_forward", "parts"),
               ("output", "self.parts")}
"""(attribute, receiver) pairs that are no model: the output flags (`cfg.output`), the
spec's own ModelPlan and ModelParts fields."""
INTERNAL_PATHS = re.compile(r"tok_embeddings|(^|\.)layers\.|\.(attention|moe)\.|^moe\.")
"""A string naming a family's module path (`layers.3.moe.router`, `tok_embeddings`)."""


def outside_families() -> list[Path]:
    """Every module but those of a family's own folder and the registration list."""
    return [p for p in sorted(SRC.rglob("*.py"))
            if p.relative_to(SRC).parts[:2] not in {("models", f) for f in FAMILIES}
            and p.relative_to(SRC).as_posix() != REGISTRATION]


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose may name anything)."""
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def reach_ins(path: Path, root: Path = SRC) -> list[str]:
    """Each place the module names a family's submodule (an attribute, or a string that is a
    module path; not prose: docstrings and comments are left alone) or imports anything from
    a family's folder."""
    found = []
    tree = ast.parse(path.read_text())
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SUBMODULES:
            receiver = ast.unparse(node.value)
            if (node.attr, receiver) not in NOT_A_MODEL and receiver != "spec":
                found.append(f"{path.relative_to(root)}:{node.lineno} {receiver}.{node.attr}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in prose and INTERNAL_PATHS.search(node.value):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["loom", "models"] and len(parts) >= 3 and parts[2] in FAMILIES \
                    and parts[2] != HUB_LOADER:
                found.append(f"{path.relative_to(root)}:{node.lineno} import {name}")
    return found


def test_no_module_outside_the_families_names_their_submodules() -> None:
    found = [hit for path in outside_families() for hit in reach_ins(path)]
    assert not found, "reach into a family (ask its spec instead):\n" + "\n".join(found)


def test_the_scan_finds_a_reach_in(tmp_path: Path) -> None:
    """The scan is not blind: each kind of reach-in it forbids is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from loom.models.moe.flags import moe_flags\n"
                     "def f(model, block):\n    '''model.layers.0 in prose'''\n"
                     "    return model.tok_embeddings, block.moe.router, model.output,"
                     " cfg.output, 'layers.1.moe.router', plan.container  # model.layers\n")
    found = reach_ins(probe, tmp_path)
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "'layers.1.moe.router'", "block.moe", "import loom.models.moe.flags", "model.output",
        "model.tok_embeddings"]


def model_class_attributes() -> set[str]:
    """Names a model module of some family declares at class level and reads (public, not a
    method): where a layout could set a value for the model to read. Records (dataclasses:
    the spec, `ForwardContext`, arguments) are not modules."""
    names = set()
    for path in (SRC / "models").rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and not any(
                    "dataclass" in ast.unparse(d) for d in cls.decorator_list):
                for stmt in cls.body:
                    targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else \
                        stmt.targets if isinstance(stmt, ast.Assign) else []
                    names |= {t.id for t in targets if isinstance(t, ast.Name)
                              and not t.id.startswith("_") and stmt.value is not None}
    return names - {"args"}  # a model's own arguments, set by its constructor


def attribute_writes(path: Path, names: set[str], root: Path = SRC) -> list[str]:
    """Each `x.name = ...` or `setattr(x, "name", ...)` of one of `names` in the module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        hits = [t.attr for t in targets if isinstance(t, ast.Attribute) and t.attr in names]
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in names:
            hits.append(node.args[1].value)
        found += [f"{path.relative_to(root)}:{node.lineno} .{hit}" for hit in hits]
    return found


def test_nothing_outside_the_families_sets_what_a_model_reads() -> None:
    """A layout hands a model what it needs in its `ForwardContext`; a family's own code
    (its plan, its spec's `weigh_own_losses`) may set its modules' switches, nothing else."""
    names = model_class_attributes()
    found = [hit for path in outside_families() for hit in attribute_writes(path, names)]
    assert not found, "set on a model from outside its family:\n" + "\n".join(found)


def test_the_attribute_scan_finds_a_write(tmp_path: Path) -> None:
    assert {"forwards_per_step", "sequence_sum"} <= model_class_attributes()
    probe = tmp_path / "probe.py"
    probe.write_text("def f(moe, model):\n    moe.forwards_per_step = 4\n"
                     "    setattr(model, 'sequence_sum', None)\n    moe.other = 1\n")
    assert [f.split(" ", 1)[1] for f in attribute_writes(
        probe, {"forwards_per_step", "sequence_sum"}, tmp_path)] == [
        ".forwards_per_step", ".sequence_sum"]


def test_models_never_import_the_parallel_code() -> None:
    """A family's plan (`models/<family>/plan.py`) applies parallelism and is the one
    exception; nothing in a folder imports the trainer."""
    found = []
    for path in sorted((SRC / "models").rglob("*.py")):
        if path.name == "plan.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(SRC)}: {n}" for n in names
                      if n.startswith(("loom.parallel", "loom.trainer"))]
    assert not found, found


def test_a_built_model_names_its_family_not_its_class() -> None:
    small = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1"]
    qwen3 = plain_model(parse_args(["--family", "qwen3", *small]))
    assert type(qwen3) is Transformer and for_model(qwen3).name == "qwen3"
    assert for_model(plain_model(parse_args(small))).name == "llama"
    assert for_model(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2,
                                           n_kv_heads=1))).name == "llama"  # unmarked


def test_the_expert_bias_hook_is_the_moe_spec_s_not_an_import_side_effect() -> None:
    assert "moe-expert-bias" not in extensions._STEP_HOOKS
    hooks = {h.name for h in extensions.active_step_hooks(parse_args(["--model", "moe-debug"]))}
    assert "moe-expert-bias" in hooks
    dense = {h.name for h in extensions.active_step_hooks(parse_args(["--model", "debug"]))}
    assert "moe-expert-bias" not in dense


GPT2 = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "max_seq_len": 128,
        "gpt2_activation": "gelu"}


@pytest.mark.parametrize(("args", "message"), [
    ({**GPT2, "n_kv_heads": 4}, r"model_args has unknown key 'n_kv_heads' \(the gpt2-test "
                                r"family has no such field\)"),
    ({k: v for k, v in GPT2.items() if k != "max_seq_len"}, "model_args lacks max_seq_len"),
    ({**GPT2, "dim": "64"}, "model_args.dim is '64', not int"),
    ({**GPT2, "dim": True}, "model_args.dim is True, not int"),
    ({**GPT2, "n_heads": -1}, r"model_args.n_heads is -1, not an integer in \[0, "),
])
def test_model_args_are_checked_against_the_family_s_dataclass(args: dict, message: str
                                                               ) -> None:
    check_record({"family": "gpt2-test", **GPT2}, GPT2)
    with pytest.raises(RecordError, match=message) as error:
        check_record({"family": "gpt2-test", **GPT2}, args)
    assert "\n" not in str(error.value)


def test_the_architecture_names_a_family_and_repeats_its_arguments() -> None:
    with pytest.raises(RecordError, match="architecture.family is 'gpt3', not one of"):
        check_record({"family": "gpt3", **GPT2}, GPT2)
    with pytest.raises(RecordError, match="architecture lacks n_layers"):
        check_record({"family": "gpt2-test", "dim": 64}, GPT2)
    with pytest.raises(RecordError, match="architecture has unknown key 'kind'"):
        check_record({"family": "gpt2-test", **GPT2, "kind": "dense"}, GPT2)


def legacy(cfg_flags: list[str], kind: str, **arch: object) -> dict:
    """The record loom wrote before families owned their arguments."""
    args = vars(model_args(parse_args(cfg_flags)))
    later = {"head_dim", "qk_norm", "rope_factor", "rope_low_freq_factor",
             "rope_high_freq_factor", "rope_original_max_seq_len", "tie_embeddings"}
    shape = {k: args[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
    flat = {k: v for k, v in args.items() if k not in later or arch.get(k)}
    return {"model_args": flat, "architecture": {"kind": kind, **shape, **arch}}


@pytest.mark.parametrize(("flags", "kind", "arch", "family"), [
    (["--model", "debug"], "dense", {}, "llama"),
    (["--model", "debug", "--family", "qwen3"], "dense",
     {"family": "qwen3", "qk_norm": 1}, "qwen3"),
    (["--model", "moe-debug"], "moe", {"n_experts": 8}, "moe"),
])
def test_an_old_flat_record_reads_as_family_and_arguments(flags: list[str], kind: str,
                                                          arch: dict, family: str) -> None:
    record = legacy(flags, kind, **arch)
    if family == "qwen3":
        record["model_args"]["qk_norm"] = True
    new = upgrade(record)
    check_record(new["architecture"], new["model_args"])
    assert new["architecture"]["family"] == family
    cfg = parse_args(flags)
    current = architecture(cfg, model_args(cfg))
    check_architecture(new["architecture"], current)  # resumes with the same flags
    other = parse_args([*flags, "--n-layers", "3"])
    with pytest.raises(ConfigError, match="checkpoint has n_layers"):
        check_architecture(new["architecture"], architecture(other, model_args(other)))


def test_an_argument_that_shapes_nothing_changes_on_resume_only_when_asked() -> None:
    """RoPE's base changes no shape but what the model computes: refused on resume unless
    --resume-change-model, which lists it."""
    cfg = parse_args(["--model", "debug"])
    saved = architecture(cfg, model_args(cfg))
    later = replace(cfg, model=replace(cfg.model, rope_theta=5e5))
    with pytest.raises(ConfigError, match="rope_theta .* pass --resume-change-model"):
        check_architecture(saved, architecture(later, model_args(later)))
    assert check_architecture(saved, architecture(later, model_args(later)), True) == [
        "rope_theta 10000.0 -> 500000.0"]

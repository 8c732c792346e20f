"""A family's flags live in its folder (issue #56) and keep every spelling users had: the flat
flag names, a `[model]` table and `--print-config` as loom wrote them before the move, and a
checkpoint's model record of that time."""

from __future__ import annotations

import json
import sys

import pytest

from loom.checkpoint.model_record import check_record, rebuilt_args
from loom.cli import config_toml
from loom.config import ConfigError, ModelConfig, parse_args
from loom.config.families import flag_groups
from loom.models.llama.flags import LlamaFlags
from loom.models.moe.flags import MoEFlags
from loom.models.moe.model import MoEArgs
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.resolve import model_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, a dependency on Python 3.10
    import tomli as tomllib

FLAT_TOML = """[model]
model = "moe-debug"
dim = 128
n_layers = 4
n_heads = 4
n_kv_heads = 2
multiple_of = 128
rope_theta = 10000.0
norm_eps = 1e-05
vocab_size = 32000
max_seq_len = 32768
n_experts = 8
top_k = 2
n_shared_experts = 1
moe_hidden_dim = 128
n_dense_layers = 1
score_func = "sigmoid"
route_norm = true
route_scale = 1.0
load_balance_coeff = 0.01
aux_loss_coeff = 0.0
trust_remote_code = false
model_impl = "auto"
head_dim = 16
qk_norm = true
rope_factor = 8.0
rope_low_freq_factor = 1.0
rope_high_freq_factor = 4.0
rope_original_max_seq_len = 8192
tie_embeddings = false
"""
"""The [model] table `loom train --model moe-debug --qk-norm --head-dim 16 --rope-factor 8
--print-config` printed on main before the families owned their flags (3eb03a3)."""

FLAT_RECORD = json.loads(
    '{"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 32000, '
    '"multiple_of": 128, "ffn_dim_multiplier": null, "hidden_dim": null, "rope_theta": 10000.0, '
    '"norm_eps": 1e-05, "max_seq_len": 32768, "head_dim": 16, "qk_norm": true, '
    '"rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, '
    '"rope_original_max_seq_len": 8192, "tie_embeddings": false, "n_experts": 8, "top_k": 2, '
    '"n_shared_experts": 1, "moe_hidden_dim": 128, "n_dense_layers": 1, '
    '"score_func": "sigmoid", "route_norm": true, "route_scale": 1.0, '
    '"load_balance_coeff": 0.01, "aux_loss_coeff": 0.0}')
"""That run's checkpoint `model_args`, as main (3eb03a3) wrote them."""


def test_loom_families_register_their_flag_groups():
    assert {LlamaFlags, Qwen3Flags, MoEFlags} <= set(flag_groups())
    assert not {"n_experts", "qk_norm", "rope_factor"} & {
        f for f in ModelConfig.__dataclass_fields__}  # not shared fields any more


def test_a_flat_model_table_of_before_loads_into_the_families(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(FLAT_TOML)
    cfg = parse_args(["--config", str(path), "--dataset", "random"])
    m = cfg.model
    assert (m.flags_of(MoEFlags).n_experts, m.flags_of(MoEFlags).load_balance_coeff) == (8, 0.01)
    assert (m.flags_of(Qwen3Flags).head_dim, m.flags_of(Qwen3Flags).qk_norm) == (16, True)
    assert m.flags_of(LlamaFlags).rope_factor == 8.0
    printed = tomllib.loads(config_toml(cfg))["model"]  # the families' flags come last
    old = tomllib.loads(FLAT_TOML)["model"]
    assert {k: printed.get(k) for k in old} == old  # the same flat table, read back ...
    others = {f for g in flag_groups() if not g.__module__.startswith("loom.")
              for f in g.__dataclass_fields__}
    assert set(printed) - set(old) <= others  # ... and a test family's flags if registered
    flags = parse_args(["--model", "moe-debug", "--qk-norm", "--head-dim", "16",
                        "--rope-factor", "8", "--dataset", "random"])
    assert flags.model == m and model_args(flags) == model_args(cfg)


def test_a_checkpoint_record_of_before_rebuilds_the_same_arguments():
    arch = {"family": "moe", **FLAT_RECORD}
    check_record(arch, FLAT_RECORD)
    args = rebuilt_args(arch)
    assert isinstance(args, MoEArgs) and args.head_dim == 16 and args.rope_factor == 8.0
    cfg = parse_args(["--model", "moe-debug", "--qk-norm", "--head-dim", "16",
                      "--rope-factor", "8", "--dataset", "random"])
    assert args == model_args(cfg)
    flags = ModelConfig().values()  # what `loom eval` and export rebuild the config from
    restored = ModelConfig().with_values(**{k: v for k, v in FLAT_RECORD.items() if k in flags})
    assert restored.flags_of(MoEFlags).n_experts == 8
    assert restored.values()["top_k"] == 2 and restored.flags_of(Qwen3Flags).qk_norm


def test_a_family_flag_is_validated_by_its_family():
    with pytest.raises(ConfigError, match="--top-k 9 must be in"):
        parse_args(["--model", "moe-debug", "--top-k", "9", "--dataset", "random"])
    with pytest.raises(ConfigError, match="--rope-high-freq-factor 1.0 must exceed"):
        parse_args(["--rope-factor", "8", "--rope-high-freq-factor", "1", "--dataset",
                    "random"])


def test_default_family_flags_are_not_held():
    """Equal settings make equal configs: a group at its defaults is not stored."""
    m = ModelConfig().with_values(n_experts=8)
    assert m.with_values(n_experts=0) == ModelConfig()
    with pytest.raises(TypeError):
        ModelConfig().with_values(no_such_flag=1)

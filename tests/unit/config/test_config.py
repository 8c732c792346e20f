import pytest
import torch

from loom.config import ConfigError, config_from_flags, parse_args
from loom.config.presets import ALIASES, PRESETS
from loom.models.llama.model import ModelArgs, Transformer


def test_preset_fills_fields_but_explicit_flags_win():
    cfg = parse_args(["--model", "s", "--dim", "384", "--batch-size", "8"])
    assert cfg.model.model == "s"
    assert cfg.model.dim == 384 and cfg.model.n_layers == 12
    assert cfg.train.batch_size == 8 and cfg.data.seq_len == 2048


@pytest.mark.parametrize("alias", list(ALIASES))
def test_every_alias_resolves(alias):
    assert parse_args(["--model", alias]).model.model == ALIASES[alias]


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="unknown model preset 'huge'.*debug"):
        parse_args(["--model", "huge"])


@pytest.mark.parametrize(("preset", "millions"), [
    ("s", 125), ("m", 246), ("l", 495), ("xl", 1200), ("xxl", 5900), ("xxxl", 11300)])
def test_preset_parameter_counts_match_spec(preset, millions):
    fields = {k: v for k, v in PRESETS[preset].items() if k not in ("seq_len", "batch_size")}
    with torch.device("meta"):
        model = Transformer(ModelArgs(**fields, vocab_size=32000))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e6 - millions) / millions < 0.02


def test_agpt_presets_set_vocab_hidden_and_rope():
    cfg = parse_args(["--model", "AGPT-2B"])
    assert (cfg.model.vocab_size, cfg.model.hidden_dim, cfg.model.rope_theta) == (
        256128, 11008, 50000.0)
    assert cfg.data.seq_len == 8192


def test_seq_len_env_default_and_flag_override():
    assert config_from_flags({}, environ={"SEQ_LEN": "512"}).data.seq_len == 512
    assert config_from_flags({"seq_len": 128}, environ={"SEQ_LEN": "512"}).data.seq_len == 128


def test_hidden_dim_rule():
    assert ModelArgs(dim=256, multiple_of=360).ffn_hidden_dim == 720
    assert ModelArgs(dim=256, multiple_of=256, ffn_dim_multiplier=1.3).ffn_hidden_dim == 1024
    assert ModelArgs(dim=256, hidden_dim=100).ffn_hidden_dim == 100


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "debug", "--tp", "3"], "--n-heads 4 is not divisible by --tp 3"),
    (["--n-heads", "8", "--n-kv-heads", "3", "--dim", "64"], "does not divide --n-heads"),
    (["--model", "debug", "--n-kv-heads", "4", "--n-heads", "8", "--tp", "8"],
     "--n-kv-heads 4 is not divisible by --tp 8"),
    (["--seq-len", "4096", "--max-seq-len", "2048"], "exceeds --max-seq-len"),
    (["--model", "debug", "--seq-len", "255", "--tp", "2"], "not divisible by --tp 2"),
    (["--loss-impl", "bogus"], "invalid choice"),
    (["--sharding-strategy", "hybrid_shard"], "--dp-replicate"),
    (["--sharding-strategy", "weird"], "unknown --sharding-strategy"),
    (["--act-mem-budget", "1.5"], "--act-mem-budget"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_configurations_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_args(argv)
    assert "\n" not in str(info.value)


def test_bad_environment_override_is_an_error():
    with pytest.raises(ConfigError, match="LOOM_REDUCE_DTYPE"):
        config_from_flags({}, environ={"LOOM_REDUCE_DTYPE": "fp16"})
    cfg = config_from_flags({}, environ={"LOOM_REDUCE_DTYPE": "BFloat16"})
    assert cfg.parallel.reduce_dtype == "bf16"


def test_deprecated_sharding_strategy_maps_with_warnings():
    assert parse_args(["--sharding-strategy", "full_shard"]).parallel.reshard_after_forward == (
        "always")
    cfg = parse_args(["--sharding-strategy", "no_shard"])
    assert cfg.parallel.reshard_after_forward == "never"
    assert len(cfg.warnings) == 2 and "deprecated" in cfg.warnings[0]


def test_reshard_flag_forms():
    assert parse_args(["--reshard-after-forward"]).parallel.reshard_after_forward == "always"
    assert parse_args(["--no-reshard-after-forward"]).parallel.reshard_after_forward == "never"
    assert parse_args(["--ac", "full"]).parallel.activation_checkpoint == "block"
    assert parse_args(["--tokenizer_name", "x"]).data.tokenizer_name == "x"

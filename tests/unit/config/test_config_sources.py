"""The config package's seams: environment variables come only from the fields that declare
them, model arguments are derived from the config, errors have distinct exit codes."""

from __future__ import annotations

import signal
from dataclasses import fields

import pytest

from loom.checkpoint.resume import architecture
from loom.config import SECTIONS, ConfigError, JobConfig, config_from_flags, parse_args
from loom.config.job import flag_fields
from loom.config.schema import DataConfig
from loom.errors import (
    BAD_INPUT_EXIT,
    DIVERGED_EXIT,
    SIGINT_EXIT,
    SIGTERM_EXIT,
    NonFiniteLossError,
    Preempted,
)
from loom.models.llama.model import ModelArgs
from loom.models.moe.model import MoEArgs
from loom.models.resolve import model_args
from loom.runtime.launch_ft import GROUP_ENV, JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S, LIGHTHOUSE_ENV

ENV_FIELDS = {f.metadata["env"]: name for name, (_, f) in flag_fields().items()
              if f.metadata["env"]}


def test_an_empty_environment_gives_the_defaults(monkeypatch):
    for name in ENV_FIELDS:
        monkeypatch.setenv(name, "1")
    assert DataConfig().seq_len == 1024  # no dataclass default reads os.environ
    cfg = config_from_flags({}, environ={})
    defaults = JobConfig()
    for section in SECTIONS:
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert cfg.explicit == ()


def test_every_declared_variable_sets_its_field_and_counts_as_given():
    values = {"SEQ_LEN": ("512", 512), "LOOM_METRICS": ("0", False),
              "LOOM_FSDP_DIVIDE_FACTOR": (" False ", False), "LOOM_DEBUG_LOGITS": ("true", True),
              "LOOM_REDUCE_DTYPE": ("bfloat16", "bf16"), "LOOM_COMPILE_BACKEND": ("AOT_EAGER",
                                                                                 "aot_eager"),
              "LOOM_HF_LIMIT_SEED": ("7", 7), "LOOM_CACHE_DIR": ("/tmp/c", "/tmp/c"),
              "LOOM_LOG_EVERY": ("3", 3), "LOOM_HEALTH_EVERY": ("2", 2),
              "LOOM_HIST_EVERY": ("4", 4), "LOOM_HIST": ("grads, acts", "grads,acts"),
              "LOOM_GLOO_COLLECTIVES": ("Native", "native"), "LOOM_HIST_BINS": ("16", 16),
              "LOOM_HIST_SAMPLES": ("100", 100), "LOOM_HIST_LAYERS": ("0, 3", "0,3"),
              "LOOM_TRACK_LOGITS": ("1", True), "LOOM_SINGLE_DEVICE": ("FSDP2", "fsdp2")}
    assert set(values) | set(FT_VALUES) == set(ENV_FIELDS), set(values) ^ set(ENV_FIELDS)
    cfg = config_from_flags({}, environ={name: raw for name, (raw, _) in values.items()})
    for name, (raw, expected) in values.items():
        section, _ = flag_fields()[ENV_FIELDS[name]]
        got = getattr(getattr(cfg, section), ENV_FIELDS[name])
        assert got == expected, (name, raw, got)
    assert set(cfg.explicit) == {ENV_FIELDS[name] for name in values}


FT_VALUES = {"LOOM_FT_GROUP": ("1", 1), "LOOM_FT_LIGHTHOUSE": ("http://h:1", "http://h:1"),
             "LOOM_FT_JOIN_TIMEOUT_S": ("600.0", 600.0)}
"""What `loom launch --ft-replica-groups` hands each group: taken only with that flag."""


def test_the_launchers_replica_group_variables_set_their_fields():
    pytest.importorskip("torchft")
    cfg = config_from_flags({"ft_replica_groups": 2},
                            environ={name: raw for name, (raw, _) in FT_VALUES.items()})
    for name, (_, expected) in FT_VALUES.items():
        assert getattr(cfg.parallel, ENV_FIELDS[name]) == expected, name
    assert {GROUP_ENV, LIGHTHOUSE_ENV, JOIN_TIMEOUT_ENV} == set(FT_VALUES)  # `loom launch`'s
    assert config_from_flags({}).parallel.ft_join_timeout_s == JOIN_TIMEOUT_S  # one default
    with pytest.raises(ConfigError, match="need --ft-replica-groups"):
        config_from_flags({}, environ={"LOOM_FT_GROUP": "1"})


@pytest.mark.parametrize(("environ", "message"), [
    ({"LOOM_METRICS": "yes"}, "LOOM_METRICS must be 0 or 1, got 'yes'"),
    ({"LOOM_HIST_EVERY": "x"}, "LOOM_HIST_EVERY must be an integer, got 'x'"),
    ({"LOOM_REDUCE_DTYPE": "fp16"}, "LOOM_REDUCE_DTYPE must be fp32 or bf16, got 'fp16'"),
])
def test_a_bad_variable_is_one_line_naming_it(environ, message):
    with pytest.raises(ConfigError) as err:
        config_from_flags({}, environ=environ)
    assert str(err.value) == message


@pytest.mark.parametrize("flags", [["--model", "debug"], ["--model", "moe-debug"],
                                   ["--model", "moe-debug", "--top-k", "3", "--route-scale", "2"]])
def test_model_arguments_are_the_config_fields_of_the_same_name(flags):
    cfg = parse_args(flags)
    args = model_args(cfg)
    flags = cfg.model.values()  # the shared flags and every registered family's
    assert type(args) is (MoEArgs if flags["n_experts"] else ModelArgs)
    names = {f.name for f in fields(args)}
    assert names <= set(flags), names
    wrong = {n: (getattr(args, n), flags[n]) for n in names
             if getattr(args, n) != flags[n]
             and not (n == "head_dim" and flags["head_dim"] == 0)}  # 0: dim / n_heads
    assert not wrong, wrong


def test_architecture_records_the_kind_of_model():
    moe = parse_args(["--model", "moe-debug"])
    arch = architecture(moe, model_args(moe))
    assert (arch["family"], arch["n_experts"], arch["moe_hidden_dim"]) == ("moe", 8, 128), arch
    hf = parse_args(["--model", "owner/repo", "--model-impl", "transformers"])
    arch = architecture(hf, model_args(hf))
    assert (arch["family"], arch["model"]) == ("transformers", "owner/repo") and \
        "ffn_hidden_dim" not in arch, arch


def test_exit_codes_are_distinct_and_divergence_is_not_bad_input():
    assert not issubclass(NonFiniteLossError, ConfigError)
    assert (BAD_INPUT_EXIT, DIVERGED_EXIT, SIGTERM_EXIT, SIGINT_EXIT) == (2, 3, 143, 130)
    assert Preempted("stopped", signal.SIGTERM).exit_code == SIGTERM_EXIT
    assert Preempted("stopped", signal.SIGINT).exit_code == SIGINT_EXIT

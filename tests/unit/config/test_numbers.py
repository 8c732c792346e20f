"""Every number a user can set is checked in one place (`loom.config.numbers`, against the
range each `flag()` declares): a bad value, from a flag, the environment or a --config
file, is exit 2 and one `error:` line naming the flag, before anything is allocated or
written. The sweep below is generated from the schema, so a new flag is covered as it is
declared; the table holds the cases found by hand (issue 59) through the command itself."""

from __future__ import annotations

import math

import pytest

from loom.cli import run_train
from loom.config import ConfigError, parse_args
from loom.config.declare import INT64_MAX
from loom.config.job import flag_fields
from loom.config.presets import PRESETS
from loom.lora.converter import lora_targets_for

BASE = ["--model", "debug", "--dataset", "random", "--max-steps", "1", "--fp32"]
TABLE = {  # id: (flags, what the one line says)
    "rope-theta-0": (["--rope-theta", "0"], "--rope-theta must be a finite number > 0, got 0.0"),
    "rope-theta-nan": (["--rope-theta", "nan"], "--rope-theta must be a finite number > 0"),
    "norm-eps-0": (["--norm-eps", "0"], "--norm-eps must be > 0, got 0.0"),
    "norm-eps-nan": (["--norm-eps", "nan"], "--norm-eps must be in (0, 1), got nan"),
    "head-dim-negative": (["--head-dim", "-1"], "--head-dim must be >= 0, got -1"),
    "head-dim-odd": (["--head-dim", "7"], "--head-dim = 7 must be even"),
    "ffn-multiplier-nan": (["--ffn-dim-multiplier", "nan"], "--ffn-dim-multiplier must be in"),
    "ffn-multiplier-negative": (["--ffn-dim-multiplier", "-1"],
                                "--ffn-dim-multiplier must be > 0, got -1.0"),
    "seed-65-bits": (["--seed", str(2**64)], "--seed must be <= 2^63-1"),
    "seed-huge": (["--seed", "9" * 40], "--seed must be <= 2^63-1, got an integer of 133 bits"),
    "seed-negative": (["--seed", "-1"], "--seed must be >= 0, got -1"),
    "lora-rank-huge": (["--lora-rank", "100000000"], "--lora-rank must be <= 65536"),
    "rope-factor-0": (["--rope-factor", "0"], "--rope-factor must be a finite number >= 1"),
    "rope-band-empty": (["--rope-factor", "8", "--rope-low-freq-factor", "4"],
                        "--rope-high-freq-factor 4.0 must exceed --rope-low-freq-factor 4.0"),
    "lora-alpha-inf": (["--lora-rank", "4", "--lora-alpha", "inf"],
                       "--lora-alpha must be a finite number > 0, got inf"),
    "gc-every-negative": (["--gc-every", "-1"], "--gc-every must be >= 0, got -1"),
    "comm-timeout-huge": (["--comm-timeout-s", "1e300"], "--comm-timeout-s must be <= 31536000"),
    "dim-huge": (["--dim", str(2**40)], "--dim must be <= 16777216"),
    "epochs-65-bits": (["--epochs", str(2**70)], "--epochs must be <= 2^63-1"),
    "mixture-exhausted-alone": (["--mixture-exhausted", "drop"],
                                "--mixture-exhausted needs a --dataset mixture"),
}
TOML = {  # id: (file text, what the one line says)
    "seed-65-bits": ("[train]\nseed = 99999999999999999999\n", "--seed must be <= 2^63-1"),
    "seed-5000-digits": (f"[train]\nseed = {'9' * 5000}\n", "Exceeds the limit (4300 digits)"),
    "rope-theta-nan": ("[model]\nrope_theta = nan\n", "--rope-theta must be a finite number"),
    "lora-alpha-inf": ("[lora]\nlora_rank = 4\nlora_alpha = inf\n", "--lora-alpha must be a"),
    "gc-every-negative": ("[train]\ngc_every = -1\n", "--gc-every must be >= 0, got -1"),
    "mixture-exhausted-alone": ('[data]\nmixture_exhausted = "stop"\n',
                                "--mixture-exhausted needs a --dataset mixture"),
}


def assert_refused(code: int, err: str, says: str) -> None:
    """Exit 2, one line, `error:` and the flag's message, no traceback."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(("flags", "says"), list(TABLE.values()), ids=list(TABLE))
def test_a_bad_number_flag_is_one_line_and_writes_nothing(tmp_path, capsys, flags, says):
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), *flags])
    assert_refused(code, capsys.readouterr().err, says)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("text", "says"), list(TOML.values()), ids=list(TOML))
def test_a_bad_number_in_a_config_file_is_one_line(tmp_path, capsys, text, says):
    (tmp_path / "run.toml").write_text(text)
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), "--config",
                      str(tmp_path / "run.toml")])
    assert_refused(code, capsys.readouterr().err, says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_a_bad_number_in_the_environment_names_flag_and_variable(tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.setenv("SEQ_LEN", "0")
    code = run_train([*BASE, "--outdir", str(tmp_path / "run")])
    assert_refused(code, capsys.readouterr().err, "--seq-len ($SEQ_LEN) must be >= 1, got 0")


def numeric_fields() -> list:
    """Every flag's, the registered families' included (`flag_fields`)."""
    return [f for _, f in flag_fields().values()
            if float in (type(f.default), f.metadata["type"])
            or (int in (type(f.default), f.metadata["type"]) and type(f.default) is not bool)]


def bad_values(f) -> list:
    """Values just outside the declared range, nan for a float, 2^63 for an integer."""
    ge, gt, le, lt, finite = f.metadata["bounds"]
    is_float = float in (type(f.default), f.metadata["type"])
    out = [math.nan, *([math.inf] if finite else [])] if is_float else [INT64_MAX + 1]
    if gt is not None:
        out.append(float(gt) if is_float else int(gt))
    elif ge is not None:
        out.append(ge - (0.5 if is_float else 1))
    if le is not None and le < INT64_MAX:
        out.append(le + (0.5 if is_float else 1))
    elif lt is not None:
        out.append(float(lt) if is_float else int(lt))
    return out


@pytest.mark.parametrize("f", numeric_fields(), ids=lambda f: f.name)
def test_every_number_of_the_schema_is_range_checked_by_flag_and_by_file(tmp_path, f):
    """Each int and float setting, generated from the schema: every value outside its
    declared range is refused, naming the flag, from the command line and from TOML."""
    section = flag_fields()[f.name][0]
    name = f"--{f.name.replace('_', '-')}"
    base = BASE if f.name != "max_steps" else BASE[:4]  # a flag would override the file
    for value in bad_values(f):
        with pytest.raises(ConfigError) as flag_error:
            parse_args([*BASE, name, str(value)])
        assert str(flag_error.value).startswith(name), (value, str(flag_error.value))
        toml = tmp_path / "run.toml"
        shown = {math.inf: "inf", -math.inf: "-inf"}.get(value, str(value))
        toml.write_text(f"[{section}]\n{f.name} = {shown}\n")
        with pytest.raises(ConfigError) as file_error:
            parse_args([*base, "--config", str(toml)])
        assert str(file_error.value).startswith(name), (value, str(file_error.value))


def test_every_number_of_the_schema_accepts_its_default():
    """The ranges admit what loom itself chose: the defaults, with every preset."""
    parse_args(BASE)
    for preset in PRESETS:
        parse_args(["--model", preset, "--dataset", "random"])


@pytest.mark.parametrize("rank, ok", [(32, True), (64, False)])
def test_lora_rank_is_bounded_by_the_narrowest_layer_it_adapts(rank, ok):
    """A rank above min(in, out) of a targeted linear adds memory, not expressiveness:
    refused before anything is built (debug: --dim 64, 2 kv heads of 16: wk is 64 -> 32)."""
    flags = ["--model", "debug", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2",
             "--dataset", "random", "--lora-rank", str(rank)]
    if ok:
        lora_targets_for(parse_args(flags))
        return
    with pytest.raises(ConfigError, match=r"--lora-rank 64 exceeds attention.wk's narrower "
                                          r"side \(32\)"):
        lora_targets_for(parse_args(flags))

"""--dtype: parsing (--fp32 is an alias), and what `auto` picks for each kind of device."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, parse_args
from loom.numerics import precision
from loom.parallel.fsdp import mixed_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("argv", "dtype"), [
    ([], "auto"), (["--fp32"], "fp32"), (["--dtype", "bf16"], "bf16"),
    (["--dtype", "fp32"], "fp32"), (["--dtype", "auto"], "auto")])
def test_dtype_flag_and_fp32_alias(argv, dtype):
    assert parse_args(argv).parallel.dtype == dtype


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="--dtype"):
        parse_args(["--dtype", "fp16"])


@pytest.mark.parametrize(("native", "dtype"), [(True, "bf16"), (False, "fp32")])
def test_auto_on_cpu_follows_native_bf16(native, dtype, monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (native, "evidence"))
    chosen = precision.resolve_precision("auto", CPU)
    assert (chosen.requested, chosen.dtype) == ("auto", dtype), chosen
    assert "evidence" in chosen.reason and ("no native" in chosen.reason) is not native


def test_explicit_dtype_is_kept_whatever_the_hardware(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (False, "evidence"))
    assert precision.resolve_precision("bf16", CPU) == precision.Precision(
        "bf16", "bf16", "--dtype bf16 given")


def test_this_cpu_reports_its_evidence():
    native, evidence = precision.cpu_bf16_support()
    assert torch.backends.cpu.get_cpu_capability() in evidence
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not native, evidence


def test_oneDNN_alone_is_not_native_bf16(monkeypatch):
    """AVX512 CPUs pass oneDNN's check but only emulate bf16: a native flag is needed."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    assert precision.cpu_bf16_support()[0] is False
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.cpu_bf16_support()[0] is True


def test_unresolved_auto_cannot_reach_the_wrappers():
    with pytest.raises(ValueError, match="not resolved"):
        mixed_precision("auto", "fp32")
    assert mixed_precision("bf16", "fp32").param_dtype == torch.bfloat16
    assert mixed_precision("fp32", "fp32").param_dtype is None

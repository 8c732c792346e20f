"""Used or refused (issue #65): every model flag, for every family, either changes the run
or is refused in one line.

The table is the families' own declaration (`ModelSpec.uses`, `loom.config.uses`), walked
whole: for each family (loom's llama, moe, qwen3, qwen3-moe, deepseek-v3, transformers'
module, and the tests' GPT-2) and each model flag, a *used* flag set to the non-default
legal value `ALTERNATIVES` gives changes what the family builds or its first step (every
parameter and buffer, the loss, every gradient, and what the family's step hooks do
after it: DeepSeek's expert-bias update reads --load-balance-coeff there), on a tiny
shape, in-process; a *refused* one makes `loom train` exit 2 with one line naming the
flag and the family, and write nothing. A model flag with no entry in `ALTERNATIVES`
fails, so the next flag cannot slip in unproved.

The flags of the other sections (optimizer, data, outputs, parallel, ...) act the same on
every family, so the table does not repeat them per family; `test_every_other_flag_is_read`
checks each is read somewhere in loom besides its declaration (a static check: it catches
a flag nothing reads, not one read and then ignored).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tests.families.gpt2  # noqa: F401  (registers the gpt2-test family)
from loom.cli import run_train
from loom.config import LossConfig, parse_args
from loom.config.job import flag_fields
from loom.config.uses import SELECTION, declared_uses, model_flag_names
from loom.losses import build_criterion
from loom.models.registry import families, for_config
from loom.parallel.init import init_weights
from tests.unit.test_bad_input import assert_one_line_exit_2

pytestmark = pytest.mark.usefixtures("loom_logger_restored")

SHAPE = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--vocab-size", "256",
         "--max-seq-len", "64", "--seq-len", "16"]
BASES = {
    "llama": ["--family", "llama", *SHAPE, "--n-kv-heads", "2"],
    "qwen3": ["--family", "qwen3", *SHAPE, "--n-kv-heads", "2"],
    "moe": ["--family", "moe", *SHAPE, "--n-kv-heads", "2", "--n-experts", "4"],
    "qwen3-moe": ["--family", "qwen3-moe", *SHAPE, "--n-kv-heads", "2", "--n-experts", "4"],
    "deepseek-v3": ["--family", "deepseek-v3", *SHAPE, "--n-experts", "4"],
    "gpt2-test": ["--family", "gpt2-test", *SHAPE],
    "transformers": ["--model", "owner/name", "--model-impl", "transformers"],
}
"""Each family's tiny shape, of flags it uses (a refused one would refuse the base)."""

RoPE = ["--rope-factor", "8"]
YARN = ["--yarn-factor", "4"]
"""YaRN's other settings act only where it extends the context."""

ALTERNATIVES: dict[str, tuple[list[str], list[str]]] = {
    # flag: (its non-default legal value, the flags it needs to act)
    "dim": (["--dim", "96"], []),
    "n_layers": (["--n-layers", "3"], []),
    "n_heads": (["--n-heads", "8"], []),
    "n_kv_heads": (["--n-kv-heads", "4"], []),
    "multiple_of": (["--multiple-of", "64"], []),
    "ffn_dim_multiplier": (["--ffn-dim-multiplier", "1.5"], ["--multiple-of", "32"]),
    "hidden_dim": (["--hidden-dim", "48"], []),
    "rope_theta": (["--rope-theta", "500"], []),
    "norm_eps": (["--norm-eps", "0.5"], []),
    "vocab_size": (["--vocab-size", "300"], []),
    "max_seq_len": (["--max-seq-len", "128"], []),
    "tie_embeddings": (["--tie-embeddings"], []),
    "rope_factor": (RoPE, ["--rope-original-max-seq-len", "16"]),
    "rope_low_freq_factor": (["--rope-low-freq-factor", "2"], RoPE),
    "rope_high_freq_factor": (["--rope-high-freq-factor", "8"], RoPE),
    "rope_original_max_seq_len": (["--rope-original-max-seq-len", "1024"], RoPE),
    "head_dim": (["--head-dim", "32"], []),
    "qk_norm": (["--qk-norm"], []),
    "n_experts": (["--n-experts", "8"], []),
    "top_k": (["--top-k", "1"], []),
    "n_shared_experts": (["--n-shared-experts", "2"], []),
    "moe_hidden_dim": (["--moe-hidden-dim", "16"], []),
    "n_dense_layers": (["--n-dense-layers", "0"], []),
    "score_func": (["--score-func", "softmax"], []),
    "route_norm": (["--no-route-norm"], []),
    "route_scale": (["--route-scale", "2.5"], []),
    "load_balance_coeff": (["--load-balance-coeff", "0.1"], []),
    "aux_loss_coeff": (["--aux-loss-coeff", "0.1"], []),
    "q_lora_rank": (["--q-lora-rank", "16"], []),
    "kv_lora_rank": (["--kv-lora-rank", "8"], []),
    "qk_nope_head_dim": (["--qk-nope-head-dim", "8"], []),
    "qk_rope_head_dim": (["--qk-rope-head-dim", "4"], []),
    "v_head_dim": (["--v-head-dim", "8"], []),
    "n_group": (["--n-group", "2"], []),
    "topk_group": (["--topk-group", "2"], ["--n-group", "2"]),
    "yarn_factor": (["--yarn-factor", "4"], []),
    "yarn_original_max_seq_len": (["--yarn-original-max-seq-len", "64"], YARN),
    "yarn_beta_fast": (["--yarn-beta-fast", "2"], YARN),
    "yarn_beta_slow": (["--yarn-beta-slow", "0.25"], YARN),
    "yarn_mscale": (["--yarn-mscale", "0.5"], [*YARN, "--yarn-mscale-all-dim", "1"]),
    "yarn_mscale_all_dim": (["--yarn-mscale-all-dim", "1"], YARN),
    "mtp_layers": (["--mtp-layers", "1"], []),
    "mtp_loss_weight": (["--mtp-loss-weight", "0.9"], ["--mtp-layers", "1"]),
    "gpt2_activation": (["--gpt2-activation", "relu"], []),
}

TABLE = [(family, flag, flag in (declared_uses(family) or ()))
         for family in BASES for flag in model_flag_names() if flag not in SELECTION]


def observe(argv: list[str]) -> dict[str, torch.Tensor]:
    """Everything one training step of the family's model shows: parameters and buffers as
    built (weights drawn from the seed and each name, as every run draws them), the loss,
    each gradient, and the state after the family's step hooks."""
    cfg = parse_args([*argv, "--fp32"])
    spec = for_config(cfg.model)
    model = spec.new(spec.args_from_config(cfg.model))
    init_weights(model, 0, torch.device("cpu"))
    model.train()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    # scored as training scores it: the family's criterion, its extra depths (MTP) included
    criterion = build_criterion(LossConfig(), None, depths=spec.depths(model))
    targets = criterion.targets(tokens[:, 1:], True)
    ctx = criterion.context(None, True)
    output = model(tokens[:, :-1]) if ctx is None else model(tokens[:, :-1], ctx=ctx)
    loss = criterion.objective(criterion.sums(output, targets))
    loss.backward()
    for hook in spec.hooks:
        hook.run(model, lambda t: t, 1, torch.tensor(1.0))
    seen = {"loss": loss.detach()}
    seen.update((f"param {n}", p.detach()) for n, p in model.named_parameters())
    seen.update((f"grad {n}", p.grad) for n, p in model.named_parameters()
                if p.grad is not None)
    seen.update((f"buffer {n}", b) for n, b in model.named_buffers())
    return seen


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def test_every_registered_family_declares_its_flags_and_every_flag_has_a_value():
    """The table covers every family loom and the tests register, and every model flag has
    a value to try (a new flag without one fails here)."""
    assert set(BASES) == {spec.name for spec in families()}, sorted(s.name for s in families())
    undeclared = [name for name in BASES if declared_uses(name) is None]
    assert not undeclared, f"families without ModelSpec.uses: {undeclared}"
    missing = [f for f in model_flag_names() if f not in SELECTION and f not in ALTERNATIVES]
    assert not missing, f"model flags with no value in ALTERNATIVES: {missing}"


@pytest.mark.parametrize(("family", "flag"), [(f, g) for f, g, used in TABLE if used],
                         ids=[f"{f}-{g}" for f, g, used in TABLE if used])
def test_a_used_flag_changes_the_model_or_its_first_step(family, flag):
    value, needs = ALTERNATIVES[flag]
    base = [*BASES[family], *needs]
    assert not same(observe(base), observe([*base, *value])), \
        f"{' '.join(value)} is declared used by {family} but changed nothing"


@pytest.mark.parametrize(("family", "flag"), [(f, g) for f, g, used in TABLE if not used],
                         ids=[f"{f}-{g}" for f, g, used in TABLE if not used])
def test_a_refused_flag_is_one_line_and_writes_nothing(family, flag, tmp_path, capsys):
    value, _ = ALTERNATIVES[flag]
    code = run_train([*BASES[family], *value, "--dataset", "random", "--max-steps", "1",
                      "--outdir", str(tmp_path / "run")])
    name = f"--{flag.replace('_', '-')}"
    assert_one_line_exit_2(code, capsys.readouterr().err,
                           f"{name} is not used by the {family} family")
    assert list(tmp_path.iterdir()) == []


def test_every_other_flag_is_read():
    """Each flag outside the model table is read somewhere in loom besides the schema that
    declares it (as an attribute, or by name as a string): a flag nothing reads fails."""
    src = Path(__file__).resolve().parents[3] / "src" / "loom"
    text = "\n".join(p.read_text() for p in src.rglob("*.py")
                     if p.name not in ("schema.py", "optim.py") or p.parent.name != "config")
    unread = [name for name, (section, _) in flag_fields().items() if section != "model"
              and not re.search(rf"\.{name}\b|[\"']{name}[\"']", text)]
    assert not unread, f"flags nothing in src/loom reads: {unread}"

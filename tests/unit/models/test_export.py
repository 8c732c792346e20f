import pytest
import torch

from loom.models.llama.hf import LlamaAdapter
from loom.models.llama.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=32,
                 max_seq_len=128, rope_theta=5000.0)


def test_exported_weights_give_the_same_logits_in_transformers():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    adapter, state = LlamaAdapter(), model.state_dict()
    config = adapter.hf_config(ARGS, "fp32")
    config.pop("architectures")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict(dict(adapter.hf_tensors(ARGS, state.__getitem__)),
                                             strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    tokens = torch.randint(ARGS.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)

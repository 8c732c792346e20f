"""--doc-mask on one process: a packed batch's loss and gradients equal those of its
documents run one by one (each weighted by its valid tokens), in fp32."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, LossConfig
from loom.losses import IGNORE_INDEX, build_criterion
from loom.models.context import ForwardContext
from loom.models.documents import document_mask, document_positions
from loom.models.llama.model import ModelArgs, Transformer
from loom.trainer.executor import check_takes_documents
from loom.trainer.step import document_ids
from tests.tiny import tiny_model

EOT = 1
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                 max_seq_len=64)


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of several documents each (EOT inside), some labels ignored."""
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(2, ARGS.vocab_size, (2, 24), generator=gen)
    inputs[0, [4, 11, 12, 20]] = EOT  # a one-token document at 12
    inputs[1, [9]] = EOT
    labels = torch.randint(2, ARGS.vocab_size, (2, 24), generator=gen)
    labels[1, 2:5] = IGNORE_INDEX
    return inputs, labels


def loss_and_grads(model: Transformer, loss_impl: str,
                   pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss over the valid labels of every (inputs, labels, documents) piece, and
    its gradients."""
    criterion = build_criterion(LossConfig(loss_impl=loss_impl), model.output)
    model.zero_grad()
    total, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for inputs, labels, documents in pieces:
        ctx = None if documents is None else ForwardContext(documents=documents)
        loss_sum, n = criterion.model_sums(model, inputs, labels, ctx)[0], \
            (labels != IGNORE_INDEX).sum()
        total, count = total + loss_sum, count + n
    (total / count).backward()
    return (total / count).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def alone(inputs: torch.Tensor, labels: torch.Tensor) -> list[tuple]:
    """Every document of the batch as a batch of its own, positions from 0, no mask."""
    documents = document_ids(inputs, EOT)
    pieces = []
    for row in range(inputs.shape[0]):
        for doc in documents[row].unique():
            keep = documents[row] == doc
            pieces.append((inputs[row, keep][None], labels[row, keep][None], None))
    return pieces


def test_document_ids_positions_and_mask() -> None:
    inputs = torch.tensor([[5, 1, 3, 4, 1, 1, 7]])
    documents = document_ids(inputs, 1)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(documents).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    mask = document_mask(documents)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False, False]
    assert mask[6].tolist() == [False] * 6 + [True]


@pytest.mark.parametrize("loss_impl", ["eager", "chunked", "fused-linear"])
def test_packed_loss_and_grads_equal_documents_alone(loss_impl: str) -> None:
    model = tiny_model(ARGS)
    inputs, labels = packed_batch()
    loss, grads = loss_and_grads(model, loss_impl,
                                 [(inputs, labels, document_ids(inputs, EOT))])
    ref_loss, ref_grads = loss_and_grads(model, loss_impl, alone(inputs, labels))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    unmasked, _ = loss_and_grads(model, loss_impl, [(inputs, labels, None)])
    assert not torch.allclose(unmasked, ref_loss, rtol=1e-4), "the mask changed nothing"


class NoDocuments(torch.nn.Module):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


def test_a_model_without_documents_is_refused_in_one_line() -> None:
    check_takes_documents([tiny_model(ARGS)])  # loom's model takes them
    with pytest.raises(ConfigError, match="--doc-mask: the NoDocuments model takes no document"):
        check_takes_documents([tiny_model(ARGS), NoDocuments()])

"""Routing frozen to a reference run's, for MoE parity tests.

Two layouts of the same MoE run compute the router's scores in different reduction orders
(sharded matmuls, other batch shapes, other CPU kernels). A token whose best two experts
score within that rounding noise (~1e-6) can pick a different expert in each layout, and
from then on the two runs train different functions and the gradient norms part by ~3e-3
relative, as a wrong gradient would (seen on an Intel Xeon with AMX; here, on a Zen 4 EPYC
under ATEN_CPU_CAPABILITY=avx2, `few_dp4` and `few_ep2` each chose another expert than
`few_single` for one token of step 3 in layers.3, score gap 2.8e-6 and 3.0e-6, and step 5's
expert counts read 28/228 against 29/227). Parity is only a sound check
where routing is the same, so the reference run records every pick and each layout replays
them: the router still scores and chooses, the hook counts the tokens whose own choice
differs (with the score margin that made them differ) and then routes them as the
reference did. The comparison of losses, gradients and parameters keeps its tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loom.models.moe.model import TokenChoiceRouter
from loom.parallel.context import shard_sequence
from loom.parallel.init import clean_name

ROUTING_FILE = "routing.pt"
FLIPS_FILE = "routing-flips-{rank}.json"


def routers(model_parts: list[nn.Module]) -> dict[str, TokenChoiceRouter]:
    """Every router by its plain module name (the same in every layout)."""
    return {clean_name(name): m for part in model_parts for name, m in part.named_modules()
            if isinstance(m, TokenChoiceRouter)}


def tie_margin(biased: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, how far the k-th best biased score is above the (k+1)-th: the gap a
    rounding difference must cross to change the choice."""
    top = biased.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


@dataclass
class RoutingHooks:
    """Records (`reference` None) or replays (`reference` a recorded run) each router's
    picks, keyed by (forward number, router name). Activation checkpointing calls a router
    again in backward: a repeated key gets the same picks and is not counted twice. Under
    context parallel a rank routes its cp chunks of its samples (`cp` = (size, rank)), so
    it replays the reference's picks of those positions (`seq_len` long sequences)."""

    dp_rank: int
    reference: dict[int, dict[str, torch.Tensor]] | None = None
    cp: tuple[int, int] = (1, 0)
    seq_len: int = 0
    forward: int = 0
    picks: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    flips: list[dict] = field(default_factory=list)

    def install(self, model_parts: list[nn.Module]) -> None:
        """Hooks on every router (first, before tensor parallel's own output hook) and a
        forward counter on the model. The hook runs eagerly: its picks must be replaceable
        from Python, which a graph cannot do. A router compiled on its own (its block keeps
        the experts eager) runs eagerly too; inside a compiled block the hook is a graph
        break, so a block compiled fullgraph (SimpleFSDP) cannot replay."""
        model_parts[0].register_forward_pre_hook(self._next_forward)
        for name, router in routers(model_parts).items():
            router._compiled_call_impl = None
            router.register_forward_hook(torch.compiler.disable(self._hook(name)),
                                         prepend=True)

    def _next_forward(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self.forward += 1

    def _hook(self, name: str):
        def hook(router: TokenChoiceRouter, args: tuple, output: tuple) -> tuple | None:
            if not torch.is_grad_enabled() or self.forward == 0:
                return None
            _, own, scores = output
            seen = self.picks.setdefault(self.forward, {})
            if self.reference is None:
                seen.setdefault(name, own.detach().cpu())
                return None
            wanted = self._wanted(self.reference[self.forward][name], own.shape[0])
            wanted = wanted.to(own.device)
            if name not in seen:
                seen[name] = own.detach().cpu()
                self._count(name, own, wanted, scores.detach() + args[1], router.top_k)
            return router.weights_for(scores, wanted), wanted, scores
        return hook

    def _wanted(self, reference: torch.Tensor, rows: int) -> torch.Tensor:
        """The reference's picks of this rank's tokens: its dp slice of the batch's rows,
        and of each sample's positions its cp chunks."""
        cp_size, cp_rank = self.cp
        per_dp = rows * cp_size
        mine = reference[self.dp_rank * per_dp:(self.dp_rank + 1) * per_dp]
        if cp_size == 1:
            return mine
        by_sample = mine.view(-1, self.seq_len, mine.shape[-1])
        return shard_sequence(by_sample, cp_size, cp_rank).reshape(rows, -1)

    def _count(self, name: str, own: torch.Tensor, wanted: torch.Tensor,
               biased: torch.Tensor, k: int) -> None:
        differs = (own.sort(dim=-1).values != wanted.sort(dim=-1).values).any(dim=-1)
        margins = tie_margin(biased, k)[differs]
        self.flips.append({"forward": self.forward, "router": name, "dp_rank": self.dp_rank,
                           "cp_rank": self.cp[1],
                           "tokens": int(differs.sum()), "rows": int(own.shape[0]),
                           "max_margin": float(margins.max()) if len(margins) else 0.0})

    def save(self, outdir: Path, rank: int) -> None:
        """Rank 0 of a recording run writes the picks; every replaying rank its flips."""
        if self.reference is None:
            if rank == 0:
                torch.save(self.picks, outdir / ROUTING_FILE)
        else:
            (outdir / FLIPS_FILE.format(rank=rank)).write_text(json.dumps(self.flips))


def merged_forwards(picks: dict[int, dict[str, torch.Tensor]], n: int,
                    ) -> dict[int, dict[str, torch.Tensor]]:
    """A reference's picks recorded over `n` accumulated forwards per step, as one forward of
    the whole batch: forward f's rows are forwards n(f-1)+1 .. nf's in order. Micro-batch m
    of a step holds the samples dp rank m of a layout with dp degree n holds
    (`GlobalOrderSampler`), so a layout replays them as if the reference had run one forward."""
    return {f: {name: torch.cat([picks[n * (f - 1) + 1 + i][name] for i in range(n)])
                for name in picks[n * (f - 1) + 1]}
            for f in range(1, len(picks) // n + 1)}


def load_flips(outdir: Path) -> list[dict]:
    """Every rank's flip records of a replaying run."""
    return [r for path in sorted(outdir.glob(FLIPS_FILE.format(rank="*")))
            for r in json.loads(path.read_text())]

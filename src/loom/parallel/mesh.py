"""ParallelDims: the one object that answers questions about the device mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loom.config import ConfigError, ParallelConfig, check_expert_layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimensions, outermost first."""
EP_DIMS = ("efsdp", "ep", "etp")
"""Dims of the expert (sparse) mesh that the dense mesh lacks. With expert parallel the world
is also laid out as (pp, dp_replicate, efsdp, ep) at etp 1, where efsdp x ep spans
dp_shard x cp x tp, or as (pp, dp_replicate, efsdp, ep, etp) at etp = tp, where efsdp x ep
spans dp_shard x cp and etp is the tp ranks again. ep is innermost, so at etp 1 it takes
tp ranks first, then cp, then dp_shard ones, as torchtitan lays it out."""


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes all remaining ranks.

    Validation happens on construction, before any collective runs, so a bad layout fails
    the same way on every rank. Expert parallel spans `ep` of the dp_shard x cp x tp ranks
    (etp 1: experts split across tp ranks as whole experts) or of the dp_shard x cp ranks
    (etp = tp: every expert also tensor-parallel); routed experts are FSDP-sharded over the
    rest of that region (`efsdp`).
    Context parallel splits each sequence across `cp` ranks that share their samples;
    pipeline parallel splits the layers across `pp` ranks that share theirs.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    etp: int = 1
    cp: int = 1
    pp: int = 1
    replica_groups: int = 1
    """--ft-replica-groups: this many such meshes, each its own launch (`loom.trainer.
    replica_groups`), read the data and average their gradients as one more dp dimension."""
    replica_group: int = 0
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "cp", "tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, "
                                  f"got {getattr(self, name)}")
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                raise ConfigError(
                    f"--dp-shard -1 (auto) needs world size {self.world_size} divisible by "
                    f"{self.layout(skip='dp_shard')} = {rest}")
            self.dp_shard = self.world_size // rest
        elif self.dp_shard < 1:
            raise ConfigError(f"--dp-shard must be >= 1 or -1 (auto), got {self.dp_shard}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(f"mesh {self.layout()} = {product} does not equal world size "
                              f"{self.world_size}")
        check_expert_layout(self.ep, self.etp, self.tp, self.dp_shard * self.cp,
                            "dp_shard x cp")

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(p.dp_replicate, p.dp_shard, p.tp, world_size, ep=p.ep, etp=p.etp, cp=p.cp,
                   pp=p.pp, replica_groups=p.ft_replica_groups, replica_group=p.ft_group)

    def layout(self, skip: str = "") -> str:
        """'dp_replicate 1 x dp_shard 2 x tp 2', naming pp and cp only when they are used."""
        return " x ".join(f"{name} {degree}" for name, degree in self.degrees.items()
                           if name != skip and (name not in ("pp", "cp") or degree > 1))

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    # Whether each dimension is in use (more than one rank; etp: the experts' tp is the
    # dense tp); properties, as the sizes may still be settled after construction.
    pp_enabled = property(lambda self: self.pp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    ep_enabled = property(lambda self: self.ep > 1)
    etp_enabled = property(lambda self: self.tp > 1 and self.etp == self.tp)

    @property
    def loss_size(self) -> int:
        """Ranks holding different tokens (dp x cp): FSDP averages gradients over them."""
        return self.dp_size * self.cp

    @property
    def expert_region(self) -> int:
        """Ranks that hold different experts or shards of them, for one (pp, dp_replicate)
        coordinate: dp_shard x cp x tp at etp 1, dp_shard x cp at etp = tp."""
        return self.dp_shard * self.cp * (1 if self.etp_enabled else self.tp)

    @property
    def efsdp(self) -> int:
        """Ranks the routed experts are FSDP-sharded over under expert parallel."""
        return self.expert_region // self.ep

    def global_batch_size(self, batch_size: int) -> int:
        """Samples per optimizer step: tp, cp and pp ranks share their batch, so never multiply;
        every replica group reads its own (`data_rank`)."""
        return batch_size * self.data_size

    @property
    def data_size(self) -> int:
        """Ranks reading different samples: the dp ranks of every replica group."""
        return self.dp_size * self.replica_groups

    @property
    def data_rank(self) -> int:
        """This rank's share of the data: its dp rank, after the replica groups before it."""
        return self.replica_group * self.dp_size + self.dp_rank

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh plus flattened dims: `dp` (samplers) and `loss` (where the loss and
        valid-token counts are reduced: dp, or dp x cp); with context parallel also
        `dp_shard_cp` (what FSDP shards over)."""
        mesh = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self._flat = {"dp": dp, "loss": dp}
        if self.cp_enabled:
            self._flat["loss"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self._flat["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._mesh = mesh
        if self.ep_enabled:
            self._expert_mesh = self._build_expert_mesh(mesh)
        return mesh

    def _build_expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The same ranks laid out for the routed experts (see `EP_DIMS`)."""
        world = mesh[MESH_DIMS]._flatten("world")
        names: tuple[str, ...] = ("pp", "dp_replicate", "efsdp", "ep")
        sizes: tuple[int, ...] = (self.pp, self.dp_replicate, self.efsdp, self.ep)
        if self.etp_enabled:
            names, sizes = (*names, "etp"), (*sizes, self.tp)
        return world._unflatten(0, sizes, names)

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def get_mesh(self, name: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by name: 'tp', 'pp', 'dp', 'loss', ('dp_replicate', 'dp_shard'), ...
        with expert parallel also the expert mesh's 'ep', 'efsdp', 'etp' (and
        ('dp_replicate', 'efsdp'), ('ep', 'etp'))."""
        if isinstance(name, str) and name in self._flat:
            return self._flat[name]
        names = (name,) if isinstance(name, str) else tuple(name)
        if not any(n in EP_DIMS for n in names):
            return self.mesh[names[0] if len(names) == 1 else names]
        if self._expert_mesh is None:
            raise RuntimeError(f"mesh {name!r} needs expert parallel (ep > 1) and build_mesh()")
        return self._expert_mesh[names[0] if len(names) == 1 else names]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """1-D dp_shard (x cp) mesh, or the 2-D (replicate, shard) mesh that FSDP2 treats as
        HSDP: cp ranks hold different tokens of the same samples, so they shard too."""
        shard = "dp_shard_cp" if self.cp_enabled else "dp_shard"
        if self.dp_replicate_enabled:
            return self.get_mesh(("dp_replicate", shard))
        return self.get_mesh(shard)

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Where routed experts are FSDP-sharded under expert parallel: efsdp (kept at size 1
        so mixed precision still applies), with dp_replicate for HSDP."""
        if self.dp_replicate_enabled:
            return self.get_mesh(("dp_replicate", "efsdp"))
        return self.get_mesh("efsdp")

    @property
    def dp_rank(self) -> int:
        return self.get_mesh("dp").get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.get_mesh("tp").get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.get_mesh("pp").get_local_rank()

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The pipeline's stages: the ranks holding other layers of the same tokens (what a
        step hook sums per-stage metrics over); None without pp."""
        return self.get_mesh("pp").get_group() if self.pp_enabled else None

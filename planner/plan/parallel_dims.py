"""``ParallelDims``: how a training job's GPUs divide the work, one degree per dimension.

In the spirit of torchtitan's ``ParallelDims`` (torchtitan/distributed/parallel_dims.py): the
world is a device mesh whose dimensions are data-parallel replicate (DDP), data-parallel shard
(ZeRO / FSDP), tensor (tp), context (cp), pipeline (pp) and expert (ep) parallelism; the product
of the degrees is the world size. ``sharding`` says what the shard dimension splits:

| sharding | PyTorch | ZeRO stage |
|---|---|---|
| (dp_shard = 1) | DDP over ``dp_replicate`` ranks | 0 |
| ``optimizer`` | DDP + ``ZeroRedundancyOptimizer`` | 1 |
| ``gradients`` | FSDP2 ``fully_shard(reshard_after_forward=False)`` | 2 |
| ``full`` | FSDP2 ``fully_shard(reshard_after_forward=True)`` | 3 |

``tp`` is tensor parallelism (``sp``: with sequence parallelism), the innermost dimension of the
mesh: its ranks share a node first, then context parallelism's, then data parallelism's
(torchtitan's mesh order ``[pp, dp_replicate, dp_shard, cp, tp]``). ``cp`` is context
parallelism: each rank of a group holds a share of every sequence and attention runs as a
ring; as in torchtitan, FSDP2 shards the model over the data-parallel and context-parallel
ranks together (its flattened ``dp_shard_cp`` mesh), so ``sharding`` may be set with
``dp_shard`` 1 when ``cp`` > 1.

``ep`` is expert parallelism: as in torchtitan, it is carved out of the FSDP ranks and does not
multiply the world size. Each rank of an ep group (``ep`` consecutive data-parallel ranks) holds
E/ep of every MoE block's experts and exchanges the routed tokens with its group by all-to-all;
FSDP2 shards those experts over the ``dp_shard / ep`` ranks that hold the same ones (torchtitan's
``dp_mod_ep`` mesh: one rank when ep = dp_shard).

HSDP (``dp_replicate`` > 1 with ``dp_shard`` > 1, ZeRO-2/3 only) is FSDP2 on a 2-D mesh
``[dp_replicate, dp_shard]`` as torchtitan runs it (``fully_shard(mesh=mesh["dp_replicate",
"dp_shard"])``): a rank holds 1/dp_shard of the model state, reduce-scatters inside its shard
group, then all-reduces the sharded gradient across the replicas (the replicate dimension outside
the shard one: across nodes once dp_shard fills a node). Modelled without cp, ep or pp beside it.

Modelled today: data parallelism (replicate, shard, or both as HSDP under FSDP2), tensor,
context and expert parallelism (ep with FSDP2, without cp), and pipeline parallelism with DDP,
ZeRO-1 or FSDP2 and tensor parallelism inside its stages (FSDP2 as torchtitan runs it under a
pipeline: ``planner.parallel.fsdp_pipeline``). Other layouts are refused by name, never priced
wrongly.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator


class Sharding(StrEnum):
    """What the data-parallel shard dimension splits across its ranks."""

    OPTIMIZER = "optimizer"  # ZeRO-1: optimizer state (torch ZeroRedundancyOptimizer)
    GRADIENTS = "gradients"  # ZeRO-2: FSDP2, parameters kept gathered from a unit's forward to its backward
    FULL = "full"  # ZeRO-3: FSDP2, parameters re-gathered for the backward


class Group(StrEnum):
    """A communication group of the mesh (``ParallelDims.ranks_per_node``)."""

    TP = "tp"  # a tensor-parallel group
    CP = "cp"  # a context-parallel group
    DP = "dp"  # the data-parallel ranks (DDP, ZeRO-1; under HSDP every replica's shard groups together)
    REPLICATE = "replicate"  # HSDP: the ranks holding the same shard, one per replica (its all-reduce)
    FSDP = "fsdp"  # the ranks FSDP2 shards over: data- and context-parallel together
    EP = "ep"  # an expert-parallel group: ep consecutive data-parallel ranks
    PP = "pp"  # a pipeline: one rank of each stage, world_size / pp ranks apart


class MeshAxis(StrEnum):
    """A named dimension of the device mesh (torchtitan's ``mesh_dim_names``)."""

    PP = "pp"  # the pipeline stages, outermost
    DP_REPLICATE = "dp_replicate"  # HSDP: the replicas, outside the shard dimension
    DP = "dp"  # the data-parallel ranks (replicate or shard; under HSDP the shard dimension)
    DP_MOD_EP = "dp_mod_ep"  # under expert parallelism: the data-parallel ranks holding the same experts
    EP = "ep"  # an expert-parallel group: consecutive data-parallel ranks
    CP = "cp"
    TP = "tp"


# the mesh axes each communication group spans
GROUP_AXES: dict[Group, frozenset[MeshAxis]] = {
    Group.TP: frozenset({MeshAxis.TP}),
    Group.CP: frozenset({MeshAxis.CP}),
    Group.DP: frozenset({MeshAxis.DP_REPLICATE, MeshAxis.DP, MeshAxis.DP_MOD_EP, MeshAxis.EP}),
    Group.REPLICATE: frozenset({MeshAxis.DP_REPLICATE}),
    Group.FSDP: frozenset({MeshAxis.DP, MeshAxis.DP_MOD_EP, MeshAxis.EP, MeshAxis.CP}),  # torchtitan's dp_shard_cp
    Group.EP: frozenset({MeshAxis.EP}),
    Group.PP: frozenset({MeshAxis.PP}),
}
ZERO_STAGE_OF = {None: 0, Sharding.OPTIMIZER: 1, Sharding.GRADIENTS: 2, Sharding.FULL: 3}
SHARDING_OF_STAGE = {stage: sharding for sharding, stage in ZERO_STAGE_OF.items()}
NOT_MODELLED: tuple[str, ...] = ()  # dimensions a layout may not use yet


class ParallelDims(BaseModel):
    """Degrees of each parallel dimension; their product is the world size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_replicate: PositiveInt = Field(default=1, description="data-parallel replicas (DDP)")
    dp_shard: PositiveInt = Field(default=1, description="data-parallel ranks that shard model state (ZeRO/FSDP)")
    sharding: Sharding | None = Field(default=None, description="what dp_shard splits; None when dp_shard is 1")
    tp: PositiveInt = Field(default=1, description="tensor parallel degree (ColwiseParallel / RowwiseParallel)")
    sp: bool = Field(default=False, description="sequence parallelism inside the tensor-parallel group")
    cp: PositiveInt = Field(default=1, description="context parallel degree (torch's context_parallel: ring attention)")
    pp: PositiveInt = Field(default=1, description="pipeline parallel degree: stages of the model's blocks, one per "
                            "rank of a pipeline (torch.distributed.pipelining)")
    ep: PositiveInt = Field(default=1, description="expert parallel degree: each MoE block's experts split over "
                            "this many of the FSDP2 ranks, routed tokens exchanged by all-to-all; divides dp_shard")

    @model_validator(mode="before")
    @classmethod
    def _default_sharding(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dp_shard", 1) > 1 and data.get("sharding") is None:
            return {**data, "sharding": Sharding.FULL}
        return data

    @model_validator(mode="after")
    def _modelled(self) -> ParallelDims:
        if self.dp_shard * self.cp == 1 and self.sharding is not None:
            raise ValueError(f"parallel.sharding: {self.sharding.value} needs dp_shard > 1 (or cp > 1)")
        if self.cp > 1 and self.sharding not in (Sharding.GRADIENTS, Sharding.FULL):
            raise ValueError("parallel.cp: context parallelism runs with FSDP2 over the data- and context-parallel "
                             "ranks together (torchtitan's dp_shard_cp); DDP and ZeRO-1 with it are not modelled: use "
                             "sharding gradients or full (ZeRO-2/3)")
        if self.hsdp and not self.shards_parameters:
            raise ValueError(f"parallel.dp_replicate: {self.dp_replicate} replicas of a ZeRO-1 shard group is not "
                             "modelled; HSDP (dp_replicate x dp_shard) runs under FSDP2: use sharding gradients or "
                             "full (ZeRO-2/3), or dp_replicate 1")
        if self.hsdp and (self.cp > 1 or self.ep > 1 or self.pp > 1):
            name = next(n for n in ("cp", "ep", "pp") if getattr(self, n) > 1)
            raise ValueError(f"parallel.dp_replicate: HSDP with {name} {getattr(self, name)} is not modelled (measured "
                             f"with data and tensor parallelism only); use dp_replicate 1 or {name} 1")
        if self.sp and self.tp == 1:
            raise ValueError("parallel.sp: sequence parallelism runs inside a tensor-parallel group; use tp > 1")
        if self.ep > 1 and (not self.shards_parameters or self.dp_shard % self.ep or self.cp > 1):
            raise ValueError(f"parallel.ep: expert parallelism is modelled over FSDP2's data-parallel ranks without "
                             f"context parallelism: use an ep that divides dp_shard ({self.dp_shard}) with ZeRO-2/3 and "
                             "cp 1, or ep 1")
        if self.pp > 1 and (self.cp > 1 or self.ep > 1):
            name, degree = ("cp", self.cp) if self.cp > 1 else ("ep", self.ep)
            raise ValueError(f"parallel.{name}: {name} {degree} inside pipeline stages is not modelled yet (FSDP2 under "
                             f"a pipeline was measured with data and tensor parallelism only); use {name} 1 with pp > 1")
        for name in NOT_MODELLED:
            if getattr(self, name) > 1:
                raise ValueError(f"parallel.{name}: {getattr(self, name)} is not modelled yet; use {name} = 1")
        return self

    @classmethod
    def data_parallel_of(cls, world_size: int, zero_stage: int, tp: int = 1, sp: bool = False,
                         cp: int = 1, ep: int = 1, pp: int = 1, dp_replicate: int = 1) -> ParallelDims:
        """``world_size`` GPUs: groups of ``tp`` tensor-parallel ranks, ``cp`` such groups to a
        context-parallel group, data parallel over those at a ZeRO stage (0: DDP; 1: ZeRO-1;
        2/3: FSDP2, over the data- and context-parallel ranks; with ``dp_replicate`` > 1, HSDP:
        FSDP2 over data-parallel ranks / dp_replicate, replicated that many times)."""
        if zero_stage not in SHARDING_OF_STAGE:
            raise ValueError(f"zero_stage: {zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        if tp < 1 or cp < 1 or pp < 1 or world_size % (tp * cp * pp):
            raise ValueError(f"tp x cp x pp: {tp} x {cp} x {pp} must divide the {world_size} GPUs")
        data = world_size // (tp * cp * pp)
        if dp_replicate > 1:
            if zero_stage < 2:
                raise ValueError(f"dp_replicate: HSDP replicates FSDP2's shard groups; ZeRO-{zero_stage} is DDP or "
                                 "ZeRO-1: use zero_stage 2 or 3")
            if data % dp_replicate or data == dp_replicate:
                raise ValueError(f"dp_replicate: {dp_replicate} must divide the {data} data-parallel ranks and leave "
                                 "several to shard over")
            return cls(dp_replicate=dp_replicate, dp_shard=data // dp_replicate, sharding=SHARDING_OF_STAGE[zero_stage],
                       tp=tp, sp=sp, cp=cp, ep=ep, pp=pp)
        if dp_replicate < 1:
            raise ValueError(f"dp_replicate: {dp_replicate} must be positive")
        if data * cp == 1 or zero_stage == 0:
            if zero_stage:
                raise ValueError("zero_stage: sharding needs several data-parallel ranks; use zero_stage 0")
            return cls(dp_replicate=data, tp=tp, sp=sp, cp=cp, ep=ep, pp=pp)
        return cls(dp_shard=data, sharding=SHARDING_OF_STAGE[zero_stage], tp=tp, sp=sp, cp=cp, ep=ep, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.pp  # ep is carved out of dp_shard

    @property
    def data_parallel(self) -> int:
        """Ranks that each run their own micro-batches (replicas times shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh(self) -> tuple[tuple[MeshAxis, int], ...]:
        """The device mesh, outermost axis first, as validate builds it: torchtitan's order
        ``[pp, dp_replicate, dp_shard, cp, tp]`` (tp innermost: its ranks are neighbours, inside a
        node), ``(dp, cp, tp)`` under context parallelism; expert parallelism splits the
        data-parallel ranks into ``(dp_mod_ep, ep)`` (torchtitan's sparse mesh, etp = tp); a
        pipeline's stages outermost."""
        inner = self._inner_mesh()
        return ((MeshAxis.PP, self.pp), *inner) if self.pp > 1 else inner

    def _inner_mesh(self) -> tuple[tuple[MeshAxis, int], ...]:
        if self.hsdp:  # torchtitan's [dp_replicate, dp_shard, tp]
            tensor = ((MeshAxis.TP, self.tp),) if self.tp > 1 else ()
            return ((MeshAxis.DP_REPLICATE, self.dp_replicate), (MeshAxis.DP, self.dp_shard), *tensor)
        if self.cp > 1:
            return ((MeshAxis.DP, self.data_parallel), (MeshAxis.CP, self.cp), (MeshAxis.TP, self.tp))
        if self.ep > 1:
            tensor = ((MeshAxis.TP, self.tp),) if self.tp > 1 else ()
            return ((MeshAxis.DP_MOD_EP, self.data_parallel // self.ep), (MeshAxis.EP, self.ep), *tensor)
        if self.tp == 1:
            return ((MeshAxis.DP, self.data_parallel),)
        return ((MeshAxis.DP, self.data_parallel), (MeshAxis.TP, self.tp))

    def ranks_per_node(self, group: Group, gpus_per_node: int) -> int:
        """How many ranks of one ``group`` share a node: its ranks are ``mesh``'s ``GROUP_AXES``,
        a rank's neighbours along them ``gpus_per_node`` over the ranks of the axes inside them."""
        axes = GROUP_AXES[group]
        size, inner, inside = 1, 1, True
        for axis, degree in reversed(self.mesh):  # innermost first
            if axis in axes:
                size, inside = size * degree, False
            elif inside:
                inner *= degree
        return max(1, min(size, gpus_per_node // inner))

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP2 (or ZeRO-1) shards the model state over: the data-parallel ranks, and
        the context-parallel ranks with them (torchtitan's ``dp_shard_cp``); under HSDP one
        replica's: ``dp_shard``."""
        return (self.dp_shard if self.hsdp else self.data_parallel) * self.cp

    @property
    def hsdp(self) -> bool:
        """FSDP2 on a 2-D mesh: ``dp_replicate`` replicas of ``dp_shard`` shard ranks each."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks FSDP2 shards one rank's experts over (torchtitan's ``dp_mod_ep``)."""
        return self.fsdp_ranks // self.ep

    @property
    def shards_parameters(self) -> bool:
        """FSDP2 (ZeRO-2/3): parameters and gradients are sharded, gathered per unit."""
        return self.sharding in (Sharding.GRADIENTS, Sharding.FULL)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this layout is (for display and the plan file's summary)."""
        return ZERO_STAGE_OF[self.sharding]


_DATA_PARALLEL_LABEL = {None: "ZeRO-0 (DDP)", Sharding.OPTIMIZER: "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
                        Sharding.GRADIENTS: "ZeRO-2 (FSDP2)", Sharding.FULL: "ZeRO-3 (FSDP2)"}


def layout_label(dims: ParallelDims) -> str:
    """``ZeRO-3 (FSDP2) × 8, CP 2, TP 8 + SP``: each dimension in use and its degree, data
    parallelism first."""
    parts = []
    if dims.hsdp:
        parts.append(f"HSDP: {_DATA_PARALLEL_LABEL[dims.sharding]} × {dims.dp_shard}, {dims.dp_replicate} replicas")
    elif dims.data_parallel > 1:
        parts.append(f"{_DATA_PARALLEL_LABEL[dims.sharding]} × {dims.data_parallel}")
    elif dims.cp > 1:
        parts.append(f"{_DATA_PARALLEL_LABEL[dims.sharding]} over the CP ranks")
    if dims.cp > 1:
        parts.append(f"CP {dims.cp}")
    if dims.tp > 1:
        parts.append(f"TP {dims.tp}" + (" + SP" if dims.sp else ""))
    if dims.ep > 1:
        parts.append(f"EP {dims.ep}")
    if dims.pp > 1:
        parts.append(f"PP {dims.pp}")
    return ", ".join(parts) or "one GPU"

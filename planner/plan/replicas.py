"""HSDP's degree in a request: ``--dp-replicate`` checked against the other flags, and the
replicas the search tries (``planner.plan.layouts`` asks; ``ParallelDims`` holds the rules between
the degrees alone)."""

from __future__ import annotations

from planner.errors import ConfigError

SHARD_NODES = (1, 2, 4)  # nodes per HSDP shard group the search tries (--dp-replicate fixes any)


def replicate_degrees(gpus: int, fixed: int | None, gpus_per_node: int = 8) -> tuple[int, ...]:
    """The HSDP replicas a request allows: ``--dp-replicate`` if given (a positive divisor of the
    GPUs; ``ParallelDims`` refuses the rest), else 1 and the degrees that leave each replica
    ``SHARD_NODES`` whole nodes (its shard group fills one, two or four nodes: the all-reduce
    across replicas runs over the network, the all-gathers and reduce-scatters inside nodes or
    a few of them; larger shard groups are flat FSDP2's near twins and only cost search time)."""
    if fixed is not None:
        if fixed <= 0 or gpus % fixed:
            raise ConfigError(f"--dp-replicate: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
        return (fixed,)
    nodes = gpus // gpus_per_node if gpus % gpus_per_node == 0 else 1
    return (1, *(nodes // n for n in SHARD_NODES if n < nodes and nodes % n == 0))


def replica_update(gpus: int, replicas: int | None, stage: int | None, others: dict[str, int | None]) -> dict:
    """``--dp-replicate`` (``replicas``) against the other flags (``others``: the request's cp, ep
    and pp; None where searched), one line each: what the request should change. Left out, 1
    where no HSDP can run beside them; given, the degrees HSDP is not modelled with fixed to 1."""
    if replicas is None:
        fixed_off = (stage is not None and stage < 2) or any((degree or 1) > 1 for degree in others.values())
        return {"dp_replicate": 1} if fixed_off else {}
    if replicas <= 0 or gpus % replicas:
        raise ConfigError(f"--dp-replicate: {replicas} must be a positive divisor of the {gpus} GPUs (--gpus)")
    if replicas == 1:
        return {}
    if stage is not None and stage < 2:
        raise ConfigError(f"--dp-replicate: HSDP replicates FSDP2's shard groups; --zero-stage {stage} is "
                          f"{'DDP' if stage == 0 else 'ZeRO-1'}, whose ranks are all replicas already: use --zero-stage "
                          "2 or 3, or leave --dp-replicate out")
    for name, degree in others.items():
        if (degree or 1) > 1:
            raise ConfigError(f"--dp-replicate: HSDP with --{name} {degree} is not modelled (measured with data and "
                              f"tensor parallelism only); leave out --dp-replicate or --{name}")
    return dict.fromkeys(others, 1)

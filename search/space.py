"""What the search may choose: micro-batch sizes, precision policies, checkpoint freedom."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from hardware.profile import HardwareProfile
from planner.config import ModelConfig, TrainConfig
from planner.errors import ConfigError, UnsupportedPrecisionError
from planner.knobs import GradSync, Knobs
from planner.parallel import MODELLED_STAGES, zero_stages
from planner.parallel_dims import ParallelDims
from planner.precision import PrecisionPolicy, precision_spec
from planner.strategies import SingleDevice, strategy_for

# The default policy (README "Search"): by default only a policy that trains like the fp32
# baseline (fp32 master weights and optimizer state, low-precision matmuls under autocast), so
# the fastest plan never silently changes training numerics. bf16-mixed where the device runs
# bf16, else fp16-mixed (loss scaling), else fp32. bf16-true and fp8-mixed trade numerics for
# memory or speed (PrecisionSpec.trades) and are searched only when --precision names them.
DEFAULT_PRECISIONS = (PrecisionPolicy.BF16_MIXED,)
FALLBACK_PRECISIONS = (PrecisionPolicy.FP16_MIXED, PrecisionPolicy.FP32)


class SearchSpace(BaseModel):
    """The discrete knobs the sampler picks; checkpoint placement is solved per point."""

    model_config = ConfigDict(frozen=True)
    micro_batch_sizes: tuple[int, ...]
    precisions: tuple[PrecisionPolicy, ...]
    zero_stages: tuple[int, ...] = (0,)
    fsdp_grad_sync: GradSync = GradSync.EVERY  # fixed: how ZeRO-2/3 points accumulate gradients
    data_parallel: int = 1
    gpus_per_node: int = 8
    fixed_checkpoint: tuple[int, ...] | None = None
    allow_segments: bool = True

    @property
    def size(self) -> int:
        return len(self.micro_batch_sizes) * len(self.precisions) * len(self.zero_stages)

    def layout(self, zero_stage: int) -> ParallelDims:
        """The data-parallel layout of this space's GPUs at a ZeRO stage."""
        return ParallelDims.data_parallel_of(self.data_parallel, zero_stage)

    def strategy(self, zero_stage: int) -> SingleDevice:
        return strategy_for(self.layout(zero_stage))

    def allows(self, precision: PrecisionPolicy | str, zero_stage: int) -> bool:
        """Whether this precision can run at this ZeRO stage (FSDP2 runs fewer policies)."""
        return self.strategy(zero_stage).runs(PrecisionPolicy(precision))

    def knobs_at(self, training: TrainConfig, micro_batch_size: int, precision: PrecisionPolicy | str,
                 zero_stage: int) -> Knobs:
        """The knobs of one point, checkpointing nothing; accumulation fills each GPU's share."""
        layout = self.layout(zero_stage)
        return Knobs(
            micro_batch_size=micro_batch_size,
            grad_accum_steps=training.global_batch_size // (micro_batch_size * self.data_parallel),
            precision=PrecisionPolicy(precision),
            parallel=layout,
            fsdp_grad_sync=self.fsdp_grad_sync if layout.shards_parameters else GradSync.EVERY,
        )

    def known_good(self) -> list[tuple[int, PrecisionPolicy, int]]:
        """Enqueued first: the smallest micro-batch in every precision, with the most sharding
        that precision allows (the likeliest to fit)."""
        return [(self.micro_batch_sizes[0], p, max(z for z in self.zero_stages if self.allows(p, z)))
                for p in self.precisions]

    def neighbours(self, micro_batch_size: int, precision: str, zero_stage: int) -> list[tuple[int, str, int]]:
        """Adjacent micro-batches, then the same micro-batch in the other precisions and stages."""
        sizes = self.micro_batch_sizes
        i = sizes.index(micro_batch_size)
        out = [(sizes[j], precision, zero_stage) for j in (i - 1, i + 1) if 0 <= j < len(sizes)]
        out += [(micro_batch_size, p.value, zero_stage) for p in self.precisions if p.value != precision]
        out += [(micro_batch_size, precision, z) for z in self.zero_stages if z != zero_stage]
        return [point for point in out if self.allows(point[1], point[2])]


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def build_space(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    precisions: tuple[PrecisionPolicy, ...] | None = None,
    micro_batch_size: int | None = None,
    checkpoint_blocks: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    gpus: int = 1,
    gpus_per_node: int = 8,
    zero_stage: int | None = None,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
) -> SearchSpace:
    """The space: micro-batches that divide each GPU's share of the global batch (accumulation
    derived), precisions the device runs, ZeRO stages on several GPUs; a knob given is fixed."""
    stages = zero_stages(training, gpus, gpus_per_node, zero_stage)
    per_gpu = training.global_batch_size // gpus
    if micro_batch_size is not None:
        if micro_batch_size <= 0 or per_gpu % micro_batch_size:
            raise ConfigError(f"--micro-batch: {micro_batch_size} must be a positive divisor of the {per_gpu} "
                              f"sequences each GPU gets per step")
        sizes: tuple[int, ...] = (micro_batch_size,)
    else:
        sizes = divisors(per_gpu)
    if precisions is None:
        chosen = tuple(p for p in DEFAULT_PRECISIONS if hw.supports(precision_spec(p).matmul_precision))
        if not chosen:
            chosen = tuple(p for p in FALLBACK_PRECISIONS if hw.supports(precision_spec(p).matmul_precision))[:1]
    else:
        for p in precisions:
            spec = precision_spec(p)
            if not hw.supports(spec.matmul_precision):
                runs = ", ".join(x.value for x in hw.precisions)
                raise UnsupportedPrecisionError(
                    f"--precision: {p.value} needs {spec.matmul_precision.value} matmuls, which {hw.name} does not run "
                    f"(it runs {runs})"
                )
        chosen = tuple(dict.fromkeys(precisions))
    space = SearchSpace(micro_batch_sizes=sizes, precisions=chosen, zero_stages=stages, data_parallel=gpus,
                        gpus_per_node=gpus_per_node, fixed_checkpoint=checkpoint_blocks, allow_segments=allow_segments,
                        fsdp_grad_sync=fsdp_grad_sync)
    runnable = tuple(p for p in chosen if any(space.allows(p, z) for z in stages))  # FSDP2 runs fewer policies
    if not runnable:
        allowed = ", ".join(p.value for p in PrecisionPolicy if any(space.allows(p, z) for z in stages))
        raise ConfigError(f"--precision: {', '.join(p.value for p in chosen)} cannot run under --zero-stage "
                          f"{stages[0]} (FSDP2) as modelled; use {allowed}, or --zero-stage 0/1")
    return space.model_copy(update={"precisions": runnable})


__all__ = ["MODELLED_STAGES", "SearchSpace", "build_space", "divisors"]

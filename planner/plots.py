"""PNG charts of a plan (``plan --plot DIR``): where a picture says more than a table.

- ``pareto.png``: step time vs device memory of every non-dominated plan, the cap, the choice;
- ``memory.png``: the chosen plan's memory over one steady-state step, op by op, stacked by
  category, with the cap: the peak and what it is made of are visible at a glance.

matplotlib is an optional dependency (``pip install roofplan[plot]``).
"""

from __future__ import annotations

from pathlib import Path

from planner.errors import ConfigError
from planner.results import PlanResult


def _pyplot():  # noqa: ANN202
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib; pip install matplotlib (or roofplan[plot])") from None
    return plt


def write_plots(result: PlanResult, directory: str | Path) -> list[Path]:
    """Write the charts into ``directory`` (created if needed); return their paths."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--plot: cannot create {out}: {error.strerror or error}") from None
    plt = _pyplot()
    return [_pareto(result, out / "pareto.png", plt), _memory(result, out / "memory.png", plt)]


def _pareto(result: PlanResult, path: Path, plt) -> Path:  # noqa: ANN001
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = result.pareto or ()
    if points:
        ax.step([p.device_bytes / 1e9 for p in points], [p.step_time_s for p in points], where="post",
                marker="o", ms=3, label="Pareto front (fits)")
    best = result.best.estimate
    ax.scatter([best.memory.device_bytes / 1e9], [best.step_time_s], s=90, c="tab:red", zorder=5, label="chosen")
    for alt in result.alternatives:
        ax.scatter([alt.estimate.memory.device_bytes / 1e9], [alt.estimate.step_time_s], s=25, c="tab:gray", zorder=4)
    ax.axvline(result.hbm_cap_bytes / 1e9, color="black", ls="--", lw=1, label="cap")
    ax.set_xlabel("device memory (GB)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{result.model.name} on {result.hardware.name}: step time vs memory")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _memory(result: PlanResult, path: Path, plt) -> Path:  # noqa: ANN001
    from hardware.registry import load_hardware
    from planner.estimate import cached_graph, static_for
    from planner.memory import checkpoint_units, simulate_step
    from planner.precision import precision_spec

    knobs, model, training = result.best.knobs, result.model.config, result.training
    hw = load_hardware(result.hardware)
    graph = cached_graph(model, knobs.micro_batch_size, training.seq_len, precision_spec(knobs.precision))
    static = static_for(graph, hw, training, knobs)
    units = checkpoint_units(model.n_layers, knobs.checkpoint_blocks, knobs.checkpoint_segments)
    timeline = simulate_step(graph, static, hw.round_alloc, units, knobs.grad_accum_steps, record_trace=True)
    live = [e.live_bytes / 1e9 for e in timeline.trace]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    static_gb = (static.params_bytes + static.optimizer_bytes + static.data_bytes) / 1e9
    ax.fill_between(range(len(live)), 0, [static_gb] * len(live), color="tab:blue", alpha=0.35,
                    label="params + optimizer state + data")
    ax.fill_between(range(len(live)), static_gb, live, color="tab:orange", alpha=0.45,
                    label="grads, activations, logits, temporaries")
    ax.plot(live, color="tab:orange", lw=0.8)
    ax.axhline(result.best.estimate.memory.peak_allocated_bytes / 1e9, color="tab:red", lw=1, ls=":",
               label=f"peak {result.best.estimate.memory.peak_allocated_bytes / 1e9:.1f} GB ({timeline.peak.op})")
    ax.axhline(result.hbm_cap_bytes / 1e9, color="black", lw=1, ls="--", label="cap")
    ax.set_xlabel("op (one steady-state step: micro-batch 1, micro-batch 2, optimizer)")
    ax.set_ylabel("allocated (GB)")
    ax.set_title(f"{result.model.name}: memory over one step ({knobs.precision.value}, micro-batch "
                 f"{knobs.micro_batch_size}, {len(knobs.checkpointed)} blocks checkpointed)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

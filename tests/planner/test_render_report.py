"""The rich report on several GPUs and with precisions that change numerics: what each table is
per (GPU or all of them), the sharding of every plan, what is not modelled, what a policy trades."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from planner.precision import PRECISION_SPECS, PrecisionPolicy
from planner.program.results import PlanResult
from roofplan import api
from roofplan.render import NOT_MODELLED, alternatives_table, ops_table, report, sharding_label, time_table


def text_of(renderable: object) -> str:
    """The report as plain text, box drawing and line breaks folded into single spaces."""
    console = Console(file=io.StringIO(), width=240, color_system=None)
    console.print(renderable)
    return " ".join(console.file.getvalue().replace("│", " ").replace("┃", " ").split())  # type: ignore[attr-defined]


def columns(table: Table) -> dict[str, list[str]]:
    return {str(column.header): [str(cell) for cell in column.cells] for column in table.columns}


def test_next_best_plans_name_their_sharding_on_several_gpus(multi: PlanResult) -> None:
    assert multi.alternatives, "the search should leave next best plans to compare"
    table = columns(alternatives_table(multi))
    assert "sharding" in table
    assert table["sharding"] == [sharding_label(entry.knobs) for entry in multi.alternatives]
    for e, cell in zip(multi.alternatives, table["sharding"], strict=True):  # each layout's degrees, by name
        dims = e.knobs.parallel
        assert (f"ZeRO-{e.knobs.zero_stage}" in cell) == (dims.data_parallel > 1) and (f"TP {dims.tp}" in cell) == (dims.tp > 1)
    rows = list(zip(*table.values(), strict=True))
    shown = [row[:-2] for row in rows]  # without step time and the gap to the best
    assert len(set(shown)) == len(shown), f"rows that look identical: {shown}"


def test_one_gpu_has_no_sharding_column(single: PlanResult) -> None:
    assert "sharding" not in columns(alternatives_table(single))


def test_op_table_is_per_gpu_and_flops_for_all_gpus(multi: PlanResult, single: PlanResult) -> None:
    assert "per GPU" in str(ops_table(multi).title)
    assert "per GPU" in str(ops_table(single).title)
    assert "(with recompute), all 8 GPUs" in text_of(time_table(multi))
    assert "(with recompute), one GPU" in text_of(time_table(single))


def test_mfu_napkin_math_counts_every_gpu(multi: PlanResult) -> None:
    text = text_of(time_table(multi))
    assert "× 8 GPUs × " in text and "TFLOP/s" in text


def test_several_gpus_say_what_is_not_modelled(multi: PlanResult, single: PlanResult) -> None:
    text = text_of(report(multi))
    assert NOT_MODELLED in text
    for what in ("tensor", "pipeline", "context", "expert", "CPU offload", "DDP", "ZeRO-1", "FSDP2"):
        assert what in NOT_MODELLED
    assert "not modelled yet" not in text_of(report(single))


@pytest.mark.parametrize("policy", [p for p, spec in PRECISION_SPECS.items() if spec.changes_numerics])
def test_precision_that_changes_numerics_says_what_it_trades(policy: PrecisionPolicy) -> None:
    model, training = api.load_model("tiny-llama")
    result = api.plan(model, training, precisions=[policy.value], micro_batch_size=2, checkpoint="none")
    text = text_of(report(result))
    trades = " ".join((PRECISION_SPECS[policy].trades or "").split())
    assert f"{policy.value} trades numerics: {trades}" in text
    assert text.count("trades numerics") == 1


def test_precision_that_trains_like_fp32_says_nothing(single: PlanResult) -> None:
    assert not PRECISION_SPECS[single.best.knobs.precision].changes_numerics
    assert "trades numerics" not in text_of(report(single))


def test_cli_bf16_true_report_says_what_it_trades(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from roofplan.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    code = main(["--model", "tiny-llama", "--precision", "bf16-true", "--micro-batch", "2", "--checkpoint", "none"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert code == 0
    assert "bf16-true trades numerics: bf16 weights" in out

"""Rich rendering of a ValidationReport: a verdict line, then predicted vs measured."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from hardware.units import format_bytes
from roofplan.memory_compare import MemoryComparison
from roofplan.results import html_of
from validate.report import ValidationReport


def _value(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key.endswith("bytes"):
        return format_bytes(value)
    if key == "step_time_s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.4g}"


def report_group(report: ValidationReport) -> Group:
    verdict = Text("PASS " if report.passed else "FAIL ", style="bold green" if report.passed else "bold red")
    verdict.append(f"{report.model} ({report.mode.value} on {report.device}, torch {report.torch_version}, "
                   f"{report.steps} measured steps)")
    table = Table(title="Predicted vs measured", title_justify="left")
    for column in ("", "predicted", "measured", "error", "tolerance"):
        table.add_column(column, justify="left" if not column else "right")
    rows = (("peak allocated", "peak_allocated_bytes", "peak_allocated"), ("step time", "step_time_s", "step_time"),
            ("tokens/s", "tokens_per_s", None), ("FLOPs per step", "model_flops_per_step", "model_flops"),
            ("max reserved", "reserved_bytes", None))
    for label, key, error_key in rows:
        p, m = getattr(report.predicted, key), getattr(report.measured, key)
        if p is None and m is None:
            continue
        error = report.errors.get(error_key) if error_key else None
        limit = report.tolerances.get(error_key) if error_key else None
        table.add_row(label, _value(key, p), _value(key, m), f"{error:+.2%}" if error is not None else "-",
                      f"±{limit:.1%}" if limit is not None else "-")
    parts: list[Text | Table] = [verdict, table]
    if report.pipeline_ranks:
        parts.append(_pipeline_table(report))
    if report.out_of_memory:
        at = report.allocated_at_failure_bytes
        parts.append(Text(f"out of memory: does not fit ({format_bytes(at) if at else 'unknown'} allocated)",
                          style="bold red"))
    for note in report.notes:
        parts.append(Text(f"· {note}", style="dim"))
    return Group(*parts)


def _pipeline_table(report: ValidationReport) -> Table:
    """Each pipeline rank: its stages and blocks, predicted vs measured peak, and where each peaks."""
    limit = report.tolerances.get("peak_allocated")
    table = Table(title="Peak allocated per pipeline rank" + (f" (tolerance ±{limit:.1%})" if limit else ""),
                  title_justify="left", caption_justify="left",
                  caption="* the plan's busiest rank; torch's actions: F, L, B (forward, loss, backward) of "
                          "micro-batch k on stage s as Fk@ss, I/W a split backward's halves, OPT the optimizer step")
    for column in ("rank", "stage: blocks", "predicted", "measured", "error", "planner's peak at", "torch's peak at"):
        table.add_column(column, justify="right" if column in ("predicted", "measured", "error") else "left")
    for rank in report.pipeline_ranks:
        blocks = ", ".join(f"{s}: {a}-{b}" if a != b else f"{s}: {a}" for s, (a, b) in zip(rank.stages, rank.blocks,
                                                                                          strict=True))
        measured = rank.measured_peak_bytes
        table.add_row(f"{rank.rank}{' *' if rank.busiest else ''}", blocks, format_bytes(rank.predicted_peak_bytes),
                      format_bytes(measured) if measured is not None else "-",
                      f"{rank.error:+.2%}" if rank.error is not None else "not measured", rank.predicted_at,
                      rank.measured_at or "-")
    return table


def _signed_bytes(n_bytes: int) -> str:
    return ("+" if n_bytes > 0 else "-" if n_bytes < 0 else "") + format_bytes(abs(n_bytes))


def comparison_table(comparison: MemoryComparison, rows: int = 10) -> Table:
    """The ``rows`` largest differences at the peak by module and category, and what the rest add up to."""
    shown, rest = comparison.rows[:rows], comparison.rows[rows:]
    table = Table(title=f"Where the peaks differ (measured - predicted {_signed_bytes(comparison.difference_bytes)}): "
                        "live bytes at each side's peak, by module and category", title_justify="left",
                  caption=escape(f"predicted peak {format_bytes(comparison.predicted_peak_bytes)} at "
                                 f"{comparison.predicted_at}; measured peak "
                                 f"{format_bytes(comparison.measured_peak_bytes)} at {comparison.measured_at}"),
                  caption_justify="left")
    for column in ("module", "category", "predicted", "measured", "difference"):
        table.add_column(column, justify="left" if column in ("module", "category") else "right")
    for row in shown:
        table.add_row(escape(row.module) or "(model)", row.category.value, format_bytes(row.predicted_bytes),
                      format_bytes(row.measured_bytes), _signed_bytes(row.difference_bytes))
    if rest:
        table.add_row(f"{len(rest)} more rows", "", format_bytes(sum(r.predicted_bytes for r in rest)),
                      format_bytes(sum(r.measured_bytes for r in rest)),
                      _signed_bytes(sum(r.difference_bytes for r in rest)), style="dim")
    return table


def print_comparison(comparison: MemoryComparison, rows: int = 10, console: Console | None = None) -> None:
    (console or Console()).print(comparison_table(comparison, rows))


def print_report(report: ValidationReport, console: Console | None = None) -> None:
    (console or Console()).print(report_group(report))


class Validation(ValidationReport):
    """A ``ValidationReport`` that renders as the ``validate`` report (what ``roofplan.api.validate``
    returns: ``rich.print(report)`` prints it, a notebook shows it as HTML)."""

    def __rich__(self) -> RenderableType:
        return report_group(self)

    def _repr_html_(self) -> str:  # notebooks
        return html_of(report_group(self), 110)


def shown_validation(report: ValidationReport) -> Validation:
    """The same report (no copy of its fields), as a ``Validation``."""
    if isinstance(report, Validation):
        return report
    return Validation.model_construct(_fields_set=report.model_fields_set, **dict(report))

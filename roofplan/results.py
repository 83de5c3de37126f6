"""What the API returns: the core result types, able to show themselves.

``planner.program.results.PlanResult`` is plain data (the plan file, ``--json``); rendering lives up here
in the app layer. The API returns this subclass, so ``rich.print(result)`` prints the report and
a notebook shows it as HTML (``roofplan.validate_render.Validation`` does the same for a
validation report).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from planner.program.results import PlanResult

if TYPE_CHECKING:
    from rich.console import RenderableType


def html_of(renderable: RenderableType, width: int) -> str:
    from rich.console import Console  # not at import: ``plan --json`` never renders

    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_html(inline_styles=True)


class Plan(PlanResult):
    """A ``PlanResult`` that renders as the ``plan`` report."""

    def __rich__(self) -> RenderableType:
        from roofplan.render import report

        return report(self)

    def _repr_html_(self) -> str:  # notebooks
        return html_of(self.__rich__(), 120)

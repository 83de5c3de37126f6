"""The one-way flow of docs/design.md, enforced by an ``ast`` walk over every module of our packages.

    hardware  <-  planner  <-  search / validate  <-  roofplan (api, CLI, report, plots, advice)

- ``hardware`` imports nothing of ours;
- the planner core imports only ``hardware`` and ``planner``;
- ``search`` and ``validate`` import the core and themselves, never each other nor ``roofplan``;
- only ``search`` imports optuna; only ``validate`` imports torch or einops;
- the file import graph has no cycles (imports inside functions and ``TYPE_CHECKING`` ones count);
- ``plan`` without ``--validate`` never imports torch or optuna.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hardware", "planner", "search", "validate", "roofplan")
# what each package may import of ours (roofplan, the app layer, anything)
ALLOWED = {
    "hardware": {"hardware"},
    "planner": {"hardware", "planner"},
    "search": {"hardware", "planner", "search"},
    "validate": {"hardware", "planner", "validate"},
    "roofplan": set(PACKAGES),
}


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name imported
    line: int
    lazy: bool  # inside a function body (runs only when called)
    type_checking: bool  # under ``if TYPE_CHECKING:`` (never runs)

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def _package_of(rel: str) -> str:
    """The package a module's relative imports start from: its directory (also for __init__.py)."""
    return ".".join(Path(rel).parts[:-1])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def collect_imports(source: str, rel: str) -> list[Import]:
    """Every import in ``source`` (a module at repo-relative path ``rel``), relative ones resolved."""
    tree = ast.parse(source, filename=rel)
    package = _package_of(rel)
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, lazy, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            found.append(Import(module, node.lineno, lazy, type_checking))
            for alias in node.names:  # `from roofplan import api` imports roofplan.api
                found.append(Import(f"{module}.{alias.name}", node.lineno, lazy, type_checking))
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            child_tc = type_checking or (isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body)
            visit(child, child_lazy, child_tc)

    visit(tree, False, False)
    return found


def module_files() -> list[tuple[str, str]]:
    files = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            files.append((path.relative_to(REPO).as_posix(), path.read_text()))
    return files


def violations(rel: str, source: str) -> list[str]:
    """The import rules broken by one module."""
    owner = rel.split("/")[0]
    problems = []
    for imp in collect_imports(source, rel):
        where = f"{rel}:{imp.line} imports {imp.module}"
        if imp.top in PACKAGES and imp.top not in ALLOWED[owner]:
            allowed = ", ".join(sorted(ALLOWED[owner]))
            problems.append(f"{where}: {owner} imports only {allowed} of ours")
        if imp.top == "optuna" and owner != "search":
            problems.append(f"{where}: only search imports optuna")
        if imp.top in ("torch", "einops") and owner != "validate":
            problems.append(f"{where}: only validate imports torch/einops")
    return problems


def module_name(rel: str) -> str:
    name = rel[: -len(".py")].replace("/", ".")
    return name.removesuffix(".__init__")


def import_graph(files: list[tuple[str, str]]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a ``from pkg import name`` resolves to the
    module ``pkg.name`` if there is one, else to ``pkg``); ``TYPE_CHECKING`` imports count: a cycle
    held together by type-only imports is still a knot between the files."""
    names = {module_name(rel) for rel, _ in files}
    graph: dict[str, set[str]] = {}
    for rel, source in files:
        me = module_name(rel)
        edges = graph.setdefault(me, set())
        for imp in collect_imports(source, rel):
            target = imp.module
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != me:
                edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


MODULES = module_files()


def test_every_package_is_walked() -> None:
    walked = {rel.split("/")[0] for rel, _ in MODULES}
    assert walked == set(PACKAGES)
    assert {"roofplan/api.py", "roofplan/cli.py", "hardware/profile.py", "validate/reference_model.py"} <= {
        rel for rel, _ in MODULES
    }


@pytest.mark.parametrize(("rel", "source"), MODULES, ids=[rel for rel, _ in MODULES])
def test_import_rules(rel: str, source: str) -> None:
    assert violations(rel, source) == []


def test_the_file_import_graph_has_no_cycles() -> None:
    assert find_cycle(import_graph(MODULES)) is None


# --- the checker itself can fail ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("hardware/x.py", "from planner.model.config import ModelConfig\n", "hardware imports only hardware"),
        ("planner/graph/layer_graph.py", "import validate.simulate\n", "planner imports only hardware, planner"),
        ("planner/ops/x.py", "from ..graph import build_graph\nfrom . import base\n", None),
        ("planner/graph/layer_graph.py", "def f():\n    import search\n", "planner imports only"),
        ("planner/graph/layer_graph.py", "from roofplan.render import report\n", "planner imports only"),
        ("search/study.py", "def f():\n    from validate.simulate import simulate_step\n", "search imports only"),
        ("validate/run.py", "from roofplan.api import plan\n", "validate imports only"),
        ("roofplan/api.py", "def f():\n    from validate.simulate import simulate_step\n", None),
        ("roofplan/api.py", "from search.study import run_search\n", None),
        ("planner/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import search\n", "planner imports only"),
        ("planner/x.py", "if TYPE_CHECKING:\n    pass\nelse:\n    import search\n", "planner imports only"),
        ("planner/program/estimate.py", "def f():\n    import torch\n", "only validate imports torch"),
        ("roofplan/render.py", "import torch.nn as nn\n", "only validate imports torch"),
        ("hardware/x.py", "from einops import rearrange\n", "only validate imports torch"),
        ("validate/x.py", "import optuna\n", "only search imports optuna"),
        ("roofplan/cli.py", "def f():\n    import optuna\n", "only search imports optuna"),
        ("search/x.py", "import optuna\nfrom planner import estimate\n", None),
        ("validate/x.py", "import torch\nfrom einops import rearrange\n", None),
    ],
)
def test_checker_detects(rel: str, source: str, expected: str | None) -> None:
    found = violations(rel, textwrap.dedent(source))
    if expected is None:
        assert found == []
    else:
        assert any(expected in problem for problem in found), found


def test_cycle_finder_finds_lazy_and_package_cycles() -> None:
    files = [
        ("planner/ops/registry.py", "def load():\n    from planner.ops import norm\n"),
        ("planner/ops/norm.py", "from planner.ops.registry import register\n"),
        ("planner/ops/__init__.py", ""),
    ]
    cycle = find_cycle(import_graph(files))
    assert cycle is not None and set(cycle) == {"planner.ops.registry", "planner.ops.norm"}
    typed = [("a/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.y import Y\n"),
             ("a/y.py", "from a.x import X\n")]
    assert find_cycle(import_graph(typed)) is not None  # type-only imports knot files too


def test_relative_imports_are_resolved() -> None:
    found = collect_imports("from ..graph import build_graph\nfrom . import base\nfrom .registry import register\n",
                            "planner/ops/x.py")
    modules = {imp.module for imp in found}
    assert {"planner.graph", "planner.graph.build_graph", "planner.ops", "planner.ops.base",
            "planner.ops.registry"} <= modules
    assert [imp.line for imp in found if imp.module == "planner.ops.registry"] == [3]


# --- at run time ----------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_the_commands_import_neither_torch_nor_optuna() -> None:
    result = _python(
        "import roofplan.cli, roofplan.api, planner.program.estimate, roofplan.render, roofplan.hardware_cli; import sys; "
        "heavy = sorted(m for m in ('torch', 'optuna', 'einops', 'search', 'validate') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    assert result.returncode == 0, result.stderr


def test_plan_runs_without_importing_torch_or_optuna() -> None:
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from roofplan.cli import main
        argv = ["--model", "tiny-llama", "--micro-batch", "2", "--precision", "fp32", "--checkpoint", "none"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main([*argv, "--json"]) == 0
        json.loads(out.getvalue())
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(argv) == 0  # the rich report too
        assert "FITS" in out.getvalue()
        heavy = sorted(m for m in ("torch", "optuna", "einops", "search", "validate") if m in sys.modules)
        assert not heavy, heavy
        print("ok")
        """
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

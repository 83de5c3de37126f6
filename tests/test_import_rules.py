"""The one-way flow of DESIGN.md, enforced by an ``ast`` walk over every module of our packages.

    hardware  <-  planner  <-  search / validate      (planner.api and planner.cli import
                                                       search/validate lazily, inside functions)
- ``hardware`` imports nothing of ours;
- the planner imports only ``hardware`` and ``planner`` (the façade and CLI: search/validate
  only inside functions, never at module level);
- only ``search`` imports optuna; only ``validate`` imports torch or einops;
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
PACKAGES = ("hardware", "planner", "search", "validate")
LAZY_FACADES = {"planner/api.py", "planner/cli.py", "planner/hardware_cli.py"}


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
            for alias in node.names:  # `from planner import api` imports planner.api
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
        runs_at_import = not imp.lazy and not imp.type_checking
        if owner == "hardware" and imp.top in ("planner", "search", "validate"):
            problems.append(f"{where}: hardware imports nothing of ours")
        if owner == "planner" and imp.top in ("search", "validate"):
            if rel not in LAZY_FACADES:
                problems.append(f"{where}: the planner core imports only hardware and planner")
            elif runs_at_import:
                problems.append(f"{where}: the façade/CLI may import search/validate only inside functions")
        if imp.top == "optuna" and owner != "search":
            problems.append(f"{where}: only search imports optuna")
        if imp.top in ("torch", "einops") and owner != "validate":
            problems.append(f"{where}: only validate imports torch/einops")
    if rel == "planner/__init__.py":
        names = {imp.module for imp in collect_imports(source, rel)}
        if names & {"planner.api", "planner.cli"}:
            problems.append(f"{rel}: must not re-export the façade or the CLI (a cycle)")
    return problems


MODULES = module_files()


def test_every_package_is_walked() -> None:
    walked = {rel.split("/")[0] for rel, _ in MODULES}
    assert walked == set(PACKAGES)
    assert {"planner/api.py", "planner/cli.py", "hardware/profile.py", "validate/reference_model.py"} <= {
        rel for rel, _ in MODULES
    }


@pytest.mark.parametrize(("rel", "source"), MODULES, ids=[rel for rel, _ in MODULES])
def test_import_rules(rel: str, source: str) -> None:
    assert violations(rel, source) == []


# --- the checker itself can fail ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("hardware/x.py", "from planner.config import ModelConfig\n", "hardware imports nothing"),
        ("planner/graph.py", "import validate.simulate\n", "planner core"),
        ("planner/ops/x.py", "from ..graph import build_graph\nfrom . import base\n", None),
        ("planner/graph.py", "def f():\n    import search\n", "planner core"),
        ("planner/api.py", "from validate.simulate import simulate_step\n", "only inside functions"),
        ("planner/cli.py", "try:\n    import search\nexcept ImportError:\n    pass\n", "only inside functions"),
        ("planner/api.py", "def f():\n    from validate.simulate import simulate_step\n", None),
        ("planner/api.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import search\n", None),
        ("planner/api.py", "if TYPE_CHECKING:\n    pass\nelse:\n    import search\n", "only inside functions"),
        ("planner/estimate.py", "def f():\n    import torch\n", "only validate imports torch"),
        ("planner/render.py", "import torch.nn as nn\n", "only validate imports torch"),
        ("hardware/x.py", "from einops import rearrange\n", "only validate imports torch"),
        ("validate/x.py", "import optuna\n", "only search imports optuna"),
        ("planner/cli.py", "def f():\n    import optuna\n", "only search imports optuna"),
        ("search/x.py", "import optuna\nfrom planner import estimate\n", None),
        ("validate/x.py", "import torch\nfrom einops import rearrange\n", None),
        ("planner/__init__.py", "from planner import api\n", "re-export"),
        ("planner/__init__.py", "from . import cli\n", "re-export"),
    ],
)
def test_checker_detects(rel: str, source: str, expected: str | None) -> None:
    found = violations(rel, textwrap.dedent(source))
    if expected is None:
        assert found == []
    else:
        assert any(expected in problem for problem in found), found


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


def test_planner_imports_neither_torch_nor_optuna() -> None:
    result = _python(
        "import planner.cli, planner.api, planner.estimate, planner.render, planner.hardware_cli; import sys; "
        "heavy = sorted(m for m in ('torch', 'optuna', 'einops', 'search', 'validate') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    assert result.returncode == 0, result.stderr


def test_plan_runs_without_importing_torch_or_optuna() -> None:
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from planner.cli import main
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

"""The package's layers (pyproject.toml's ``[tool.importlinter]`` contracts) hold, and no module
imports itself back through others: runtime <- comm <- ranks <- models <- parallel <- measure <-
advise <- apps, one folder each. grimp (import-linter's graph) reads every import statement, function-local ones
included, so an import moved into a function to dodge a cycle still counts.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())", "--no-cache"]


def _lint(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(LINT_IMPORTS, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, or one module that
    imports itself (Tarjan's algorithm, iterative): each is at least one import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1 or graph.direct_import_exists(importer=node, imported=node):
                    cycles.append(sorted(component))
    return cycles


def test_the_import_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_package_has_no_import_cycle():
    cycles = import_cycles(grimp.build_graph("workbench", cache_dir=None))
    assert cycles == [], f"{len(cycles)} import cycles: {cycles}"


def test_the_cycle_count_sees_a_cycle():
    graph = grimp.ImportGraph()
    for importer, imported in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "e")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]


def test_a_bad_import_breaks_the_layers(tmp_path):
    """A copy of the package where comm imports the training loop (an app) fails the contracts."""
    shutil.copytree(ROOT / "workbench", tmp_path / "workbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    counters = tmp_path / "workbench" / "comm" / "counters.py"
    counters.write_text(counters.read_text() + "\nfrom workbench.apps import train  # a layer violation\n")
    result = _lint(tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "workbench.comm.counters -> workbench.apps.train" in result.stdout, result.stdout


# A function-local import is kept only for a module that is optional (not a dependency of the package,
# or needing a notebook) or heavy to import (pulled in only by the code path that needs it); every
# other import sits at the top of its module, where a reader and import-linter see it first.
LOCAL_IMPORTS_ALLOWED = {
    "matplotlib": "heavy: only figures import it",
    "IPython": "optional: only inside a notebook",
    "transformers": "optional: only for a Hugging Face model the user brings",
    "tqdm": "heavy for a progress bar a script may never show",
    "psutil": "optional: not a dependency, read where present",
    "workbench.ranks.magic": "needs IPython (optional): loaded by %load_ext workbench only",
    "torch.distributed.fsdp": "heavy: PyTorch's FSDP, only for comparisons with it",
    "torch.distributed.pipelining": "heavy: PyTorch's pipelining, only for comparisons with it",
    "torch.distributed.tensor": "heavy: DTensor, only for comparisons with PyTorch's tensor and context parallelism",
    "torch.distributed.device_mesh": "heavy: DTensor's mesh, only for comparisons with PyTorch",
    "torch.distributed.optim": "heavy: PyTorch's ZeroRedundancyOptimizer, only for comparisons with it",
    "torch.distributed.algorithms": "PyTorch's DDP communication hooks, only when tracing PyTorch's DDP",
    "torch.nn.attention": "only where an attention kernel is pinned",
    "torch.nn.parallel.distributed": "a private PyTorch name, read only when wrapping PyTorch's DDP",
    "torch.nn.parallel": "PyTorch's DDP, only for the strategies that wrap it (preloaded before forking)",
}


def _local_imports():
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        yield path, fn.name, node.names[0].name
                    elif isinstance(node, ast.ImportFrom) and not node.level:
                        yield path, fn.name, (node.module if node.module != "torch.distributed"
                                              else f"torch.distributed.{node.names[0].name}")


def test_function_local_imports_are_only_optional_or_heavy_modules():
    def allowed(module: str) -> bool:
        return any(module == name or module.startswith(name + ".") for name in LOCAL_IMPORTS_ALLOWED)

    bad = [f"{path.relative_to(ROOT)}: {fn}() imports {module}" for path, fn, module in _local_imports()
           if not allowed(module)]
    assert not bad, "move these imports to the top of their module:\n" + "\n".join(bad)

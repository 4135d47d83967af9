"""The import graph: data flows one way (engine or fleet -> events -> storage -> pages), checked on the source.

Every module of the product packages is parsed with `ast`; an import counts wherever it is written (at
module level, under `if TYPE_CHECKING:`, or inside a function). The rules:

    engine/     nothing from storage, app, pages, cli, analysis or fleet; the one exception is
                engine/__main__.py, the `python -m engine run-trace` alias, which imports cli.
    storage/    nothing from app, pages, cli, analysis or fleet, no streamlit, no torch or transformers;
                from the engine only the types it persists: engine.events, engine.snapshot, engine.errors.
    analysis/, fleet/ (once they exist)   no torch, no transformers, no streamlit; from the engine only
                modules whose whole import closure is torch-free (the block pool, eviction policies, KV cache
                manager, scheduler, ...: the analyzer replays traces through them), never the runner's side.
    pages/      history through `storage.queries` only.
    app/, cli/  storage through its public modules only: db, migrate, queries, recorder, writer,
                writer_process (never rows, bulk*, frame_pipe, models, rollups, retention, buckets).
    cli/        storage only inside functions (the `--db` path), so a replay without --db never loads it.
    pages/, app/  no torch and no model runner (the engine's torch side stays behind the engine's API).
    all of them   nothing from tests or benchmarks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "storage", "app", "pages", "cli", "analysis", "fleet")
STORAGE_PUBLIC = {f"storage.{name}" for name in ("db", "migrate", "queries", "recorder", "writer", "writer_process")}
STORAGE_MAY_IMPORT_FROM_ENGINE = {"engine.events", "engine.snapshot", "engine.errors"}
TORCH_SIDE = {"torch", "transformers"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing file, relative to the repository ("storage/writer.py")
    module: str  # the imported module, dotted ("engine.events")
    lazy: bool  # written inside a function (runs only when the function does)

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def within(self, *packages: str) -> bool:
        return any(self.module == package or self.module.startswith(package + ".") for package in packages)


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


class _Collector(ast.NodeVisitor):
    def __init__(self, source: str, package: str) -> None:
        self.source = source
        self.package = package  # the importing module's package, for relative imports
        self.depth = 0  # enclosing functions
        self.found: list[Import] = []

    def _add(self, module: str) -> None:
        self.found.append(Import(self.source, module, self.depth > 0))

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(filter(None, [*parent, base]))
        self._add(base)
        for alias in node.names:  # `from storage import migrate` imports the module storage.migrate
            if _is_module(f"{base}.{alias.name}"):
                self._add(f"{base}.{alias.name}")


def imports_in(package: str) -> list[Import]:
    """Every import written in the package's modules (an empty list for a package that does not exist yet)."""
    found: list[Import] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.relative_to(ROOT).as_posix()
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        collector = _Collector(source, dotted if path.name == "__init__.py" else dotted.rpartition(".")[0])
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=source))
        found.extend(collector.found)
    return found


def breaking(imports: list[Import], rule) -> list[str]:
    return [f"{found.source} imports {found.module}" + (" (in a function)" if found.lazy else "")
            for found in imports if not rule(found)]  # fmt: skip


def test_the_scanner_sees_imports_inside_functions_and_from_packages() -> None:
    """The rules below can only fail if the scanner finds what they forbid: run-trace's lazy --db import."""
    found = {(i.module, i.lazy) for i in imports_in("cli") if i.source == "cli/run_trace.py"}
    assert ("storage.writer_process", True) in found and ("engine.config", False) in found
    assert ("storage.migrate", False) in {(i.module, i.lazy) for i in imports_in("app")}  # `from storage import migrate`


def test_the_engine_imports_nothing_from_storage_the_console_the_cli_analysis_or_fleet() -> None:
    def allowed(found: Import) -> bool:
        if found.source == "engine/__main__.py" and found.within("cli"):
            return True  # the `python -m engine run-trace` alias
        return not found.within("storage", "app", "pages", "cli", "analysis", "fleet")

    assert breaking(imports_in("engine"), allowed) == []


def test_storage_imports_only_the_engine_types_it_persists_and_no_console_torch_or_streamlit() -> None:
    def allowed(found: Import) -> bool:
        if found.within("engine"):
            return found.module in STORAGE_MAY_IMPORT_FROM_ENGINE
        return not found.within("app", "pages", "cli", "analysis", "fleet", "streamlit", *TORCH_SIDE)

    assert breaking(imports_in("storage"), allowed) == []


def test_analysis_and_fleet_import_no_torch_and_no_streamlit() -> None:
    imports = imports_in("analysis") + imports_in("fleet")
    assert breaking(imports, lambda found: not found.within("streamlit", *TORCH_SIDE)) == []


def torch_free_engine_modules() -> set[str]:
    """The engine modules that import neither torch nor transformers, directly or through other modules."""
    graph: dict[str, set[str]] = {}
    for found in imports_in("engine"):
        module = found.source.removesuffix(".py").replace("/", ".")
        graph.setdefault(module, set()).add(found.module)
    tainted = {module for module, imported in graph.items() if any(m.split(".")[0] in TORCH_SIDE for m in imported)}
    changed = True
    while changed:
        reached = {module for module, imported in graph.items() if imported & tainted} - tainted
        tainted |= reached
        changed = bool(reached)
    return set(graph) - tainted


def test_the_scanner_sees_the_engines_torch_side() -> None:
    free = torch_free_engine_modules()
    assert {"engine.block_pool", "engine.eviction", "engine.scheduler", "engine.kv_coordinator"} <= free
    assert not {"engine.engine", "engine.model_runner", "engine.models"} & free


def test_analysis_and_fleet_use_only_the_engines_torch_free_modules() -> None:
    free = torch_free_engine_modules()
    imports = imports_in("analysis") + imports_in("fleet")
    assert breaking(imports, lambda found: not found.within("engine") or found.module in free) == []


def test_pages_read_the_history_through_storage_queries_only() -> None:
    def allowed(found: Import) -> bool:
        return not found.within("storage") or found.module in ("storage", "storage.queries")

    assert breaking(imports_in("pages"), allowed) == []


def test_the_app_and_the_cli_use_only_storages_public_modules() -> None:
    def allowed(found: Import) -> bool:
        return not found.within("storage") or found.module == "storage" or found.module in STORAGE_PUBLIC

    assert breaking(imports_in("app") + imports_in("cli"), allowed) == []


def test_the_cli_imports_storage_only_inside_the_commands_that_write_history() -> None:
    assert breaking(imports_in("cli"), lambda found: found.lazy or not found.within("storage")) == []


def test_the_console_imports_no_torch_and_no_model_runner() -> None:
    def allowed(found: Import) -> bool:
        return not found.within(*TORCH_SIDE, "engine.model_runner")

    assert breaking(imports_in("app") + imports_in("pages"), allowed) == []


def test_product_code_imports_nothing_from_tests_or_benchmarks() -> None:
    imports = [found for package in PRODUCT for found in imports_in(package)]
    assert breaking(imports, lambda found: not found.within("tests", "benchmarks")) == []

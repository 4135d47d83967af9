"""The import graph: data flows one way (engine or fleet -> events -> storage -> pages), checked on the source.

Every module of the product packages is parsed with `ast`; an import counts wherever it is written (at
module level, under `if TYPE_CHECKING:`, or inside a function). The rules:

    engine/core/    the torch-free bookkeeping (block pool, eviction, KV cache managers, coordinator,
                scheduler, requests, events, snapshot): imports only engine.core and the standard library
                (plus xxhash and mypy_extensions, and engine.native_guard, its stale-build check, which
                imports only the standard library): no torch, no runner, no feeds, nothing outside.
    engine/     nothing from storage, serving, app, pages, cli, analysis or fleet.
    storage/    nothing from serving, app, pages, cli, analysis or fleet's collector, no streamlit, no
                torch or transformers; from the engine only the types it persists: engine.core.events,
                engine.core.snapshot, engine.core.errors; from the fleet likewise only the types it
                persists: fleet.events, fleet.source (the fleet's storage sink lives in storage/write/, as
                the engine's recorder does).
    fleet/      nothing from storage, the engine, serving, app, pages or cli: the collector knows sinks only
                by their protocol (fleet.sinks), so its storage sink is storage's and its feed's publisher
                in the engine is the engine's.
    analysis/, fleet/   no torch, no transformers, no streamlit; analysis takes from the engine only
                engine.core (the analyzer replays traces through the engine's own pool and scheduler).
    pages/      history through storage/read/ only.
    app/, cli/, serving/  storage through its public modules only: db, migrate, read.*, and of the write
                path the writers and sinks (write.writer, write.writer_process, write.recorder,
                write.fleet_sink), never rows, bulk or schema.
    cli/        storage only inside functions (the `--db` path), so a replay without --db never loads it.
    pages/, app/  no torch and no model runner (the engine's torch side stays behind the engine's API).
    all of them   nothing from tests or benchmarks, and no import cycles between modules.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "storage", "serving", "app", "pages", "cli", "analysis", "fleet")
STORAGE_PUBLIC = {"storage.db", "storage.migrate"} | {
    f"storage.write.{name}" for name in ("writer", "writer_process", "recorder", "fleet_sink")
}
STORAGE_MAY_IMPORT_FROM_ENGINE = {"engine.core.events", "engine.core.snapshot", "engine.core.errors"}
STORAGE_MAY_IMPORT_FROM_FLEET = {"fleet.events", "fleet.source"}
CORE_MAY_IMPORT = {"xxhash", "mypy_extensions"}
CORE_MAY_IMPORT_FROM_ENGINE = {"engine.native_guard"}  # the stale-build check, outside so build_native.py can use it
TORCH_SIDE = {"torch", "transformers"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing file, relative to the repository ("storage/write/writer.py")
    module: str  # the imported module, dotted ("engine.core.events")
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
    assert ("storage.write.writer_process", True) in found and ("cli.engine_options", False) in found
    assert ("storage.migrate", False) in {(i.module, i.lazy) for i in imports_in("app")}  # `from storage import migrate`


def test_the_engine_imports_nothing_from_storage_the_console_the_cli_analysis_or_fleet() -> None:
    def allowed(found: Import) -> bool:
        return not found.within("storage", "serving", "app", "pages", "cli", "analysis", "fleet")

    assert breaking(imports_in("engine"), allowed) == []


def test_storage_imports_only_the_engine_and_fleet_types_it_persists_and_no_console_torch_or_streamlit() -> None:
    def allowed(found: Import) -> bool:
        if found.within("engine"):
            return found.module in STORAGE_MAY_IMPORT_FROM_ENGINE
        if found.within("fleet"):
            return found.module in STORAGE_MAY_IMPORT_FROM_FLEET
        return not found.within("serving", "app", "pages", "cli", "analysis", "streamlit", *TORCH_SIDE)

    assert breaking(imports_in("storage"), allowed) == []


def test_the_fleet_imports_nothing_from_storage_the_engine_or_the_console() -> None:
    def allowed(found: Import) -> bool:
        return not found.within("storage", "engine", "serving", "app", "pages", "cli")

    assert breaking(imports_in("fleet"), allowed) == []


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
    assert {"engine.core.block_pool", "engine.core.eviction", "engine.core.scheduler", "engine.core.kv_coordinator"} <= free
    assert not {"engine.engine", "engine.runner.model_runner", "engine.runner.model_loading"} & free


def test_analysis_and_fleet_take_from_the_engine_only_its_bookkeeping() -> None:
    imports = imports_in("analysis") + imports_in("fleet")
    assert breaking(imports, lambda found: not found.within("engine") or found.within("engine.core")) == []


def test_the_bookkeeping_package_imports_only_itself_and_the_standard_library() -> None:
    """engine/core/ is the torch-free layer: not torch, not the runner or the feeds, nothing outside."""
    stdlib = set(sys.stdlib_module_names)

    def allowed(found: Import) -> bool:
        return (
            found.within("engine.core")
            or found.module in CORE_MAY_IMPORT_FROM_ENGINE
            or found.top in stdlib
            or found.top in CORE_MAY_IMPORT
        )

    assert breaking(imports_in("engine/core"), allowed) == []
    guard = [found for found in imports_in("engine") if found.source == "engine/native_guard.py"]
    assert guard and [found.module for found in guard if found.top not in stdlib] == []
    assert "engine.core" in {".".join(i.module.split(".")[:2]) for i in imports_in("engine/core")}  # it sees them


def import_cycles() -> list[list[str]]:
    """The cycles of the product's module import graph (every import counted, lazy or not), by Tarjan's
    strongly connected components over modules."""
    graph: dict[str, set[str]] = {}
    for package in PRODUCT:
        for found in imports_in(package):
            source = found.source.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            if found.top in PRODUCT and found.module != source:
                graph.setdefault(source, set()).add(found.module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    assert import_cycles() == []


def test_pages_read_the_history_through_storage_queries_only() -> None:
    def allowed(found: Import) -> bool:
        return not found.within("storage") or found.within("storage.read")

    assert breaking(imports_in("pages"), allowed) == []


def test_the_app_and_the_cli_use_only_storages_public_modules() -> None:
    def allowed(found: Import) -> bool:
        return (not found.within("storage") or found.module in ("storage", "storage.read")
                or found.within("storage.read") or found.module in STORAGE_PUBLIC)

    assert breaking(imports_in("app") + imports_in("cli") + imports_in("serving"), allowed) == []


def test_the_cli_imports_storage_only_inside_the_commands_that_write_history() -> None:
    assert breaking(imports_in("cli"), lambda found: found.lazy or not found.within("storage")) == []


def test_the_console_imports_no_torch_and_no_model_runner() -> None:
    def allowed(found: Import) -> bool:
        return not found.within(*TORCH_SIDE, "engine.runner.model_runner")

    assert breaking(imports_in("app") + imports_in("pages"), allowed) == []


def test_product_code_imports_nothing_from_tests_or_benchmarks() -> None:
    imports = [found for package in PRODUCT for found in imports_in(package)]
    assert breaking(imports, lambda found: not found.within("tests", "benchmarks")) == []


def test_a_salt_becomes_a_root_key_in_one_place() -> None:
    """Issue 46: engine/core/namespace.py derives a salt's root key and binds it in the pools, and one call
    in the scheduler's admission plan asks for it; the plan carries the root to the coordinator and the
    managers, which neither derive nor register one."""
    names = ("root_key", "register_root")
    defined: list[tuple[str, str]] = []
    called: list[tuple[str, str]] = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        source = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=source)):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                defined.append((source, node.name))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                called.append((source, node.func.attr))
    namespace, scheduler = "engine/core/namespace.py", "engine/core/scheduler.py"
    assert sorted(defined) == [("engine/core/block_pool.py", "register_root"), (namespace, "root_key"), (namespace, "root_key")]
    assert sorted(called) == [(namespace, "register_root"), (namespace, "root_key"), (scheduler, "root_key")]


def test_only_the_admission_step_refuses_a_request_for_its_limits() -> None:
    """Issue 46: a request's limits were checked in four places (the API, the sampling parameters, the
    engine's input checks, the assembly) and used in one. engine/core/admission.py defines each bound and
    raises `AdmissionError` for it; every other product module maps that error to its own message and
    raises none itself (no bound checked twice, nowhere a second definition drifting from the first)."""
    admission = "engine/core/admission.py"
    raised: list[str] = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=source)):
                error = node.exc.func if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) else None
                name = error.id if isinstance(error, ast.Name) else getattr(error, "attr", None)
                if name == "AdmissionError":
                    raised.append(source)
    assert admission in raised  # the scan sees the admission step's own raises
    assert {source for source in raised if source != admission} == set()

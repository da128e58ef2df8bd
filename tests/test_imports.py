"""The house of aiokv, drawn from its import statements: no circle, arrows only point down,
and one package (the CUDA driver's) that imports cuda-python.

Every module under ``aiokv/`` is parsed with ``ast``; an import anywhere in it counts:
inside functions (a lazy import still ties the two modules together) and under ``if
TYPE_CHECKING:`` too (an annotation that names a module above still makes a reader, and
mypy, climb the house). ``LAYERS`` is the house, lowest floor first: a module may import
modules of its own floor or of floors below it, never above. Inside the CUDA package the
order is stricter (``CUDA_ORDER``): a module imports only those listed before it. There is
no list of exemptions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "aiokv"

# Lowest first. A name matches the module itself; "name.*" matches everything under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("aiokv.errors",)),
    # The transfer vocabulary, the worker options, the doorbell (an OS pipe that a
    # completion rings: a leaf primitive of the standard library, used by backends and the
    # async face alike), the worker's lifecycle states (the core and both faces read
    # them; added by the faces' branch), the optional-extras helper and the host memory
    # probe (the core and the vLLM plug-in size pools by it).
    ("vocabulary", ("aiokv.specs", "aiokv.options", "aiokv.doorbell", "aiokv.lifecycle",
                    "aiokv.extras", "aiokv.host_memory")),
    # The device's KV tensors as described, and where their pages sit in the host pool.
    ("layout", ("aiokv.layout", "aiokv.host_layout")),
    ("plan", ("aiokv.plan", "aiokv.layer_plan", "aiokv.layer_timeline")),
    ("backend interfaces", ("aiokv.backends.base", "aiokv.backends.shared_file")),
    ("backends", ("aiokv.backends.cpu", "aiokv.backends.cuda", "aiokv.backends.cuda.*")),
    ("backend selection", ("aiokv.backends",)),
    ("handler", ("aiokv.handler",)),
    # Layerwise jobs' bookkeeping, the same for both faces (the core holds it).
    ("layerwise jobs", ("aiokv.layers",)),
    ("core", ("aiokv.core",)),
    # What both faces tell of the worker they drive (one definition over the core).
    ("facts", ("aiokv.facts",)),
    ("faces", ("aiokv.loops", "aiokv.future", "aiokv.layer_future", "aiokv.poller", "aiokv.worker",
               "aiokv.sync")),
    ("users of the faces", ("aiokv.cache", "aiokv.cache.*", "aiokv.metrics")),
    ("public package", ("aiokv",)),
    ("tools and integrations", ("aiokv.integrations", "aiokv.integrations.*", "aiokv.bench",
                                "aiokv.bench.*", "aiokv.info", "aiokv.__main__")),
]

# The CUDA package, lowest first: each module imports only those before it.
CUDA_ORDER = [
    "aiokv.backends.cuda",  # its __init__ imports nothing
    "aiokv.backends.cuda.native",  # the native helper's loading (no cuda-python)
    "aiokv.backends.cuda.program",  # a job's driver calls as one native call
    "aiokv.backends.cuda.driver.codes",
    "aiokv.backends.cuda.driver.batch",
    "aiokv.backends.cuda.driver.facade",
    "aiokv.backends.cuda.driver",
    "aiokv.backends.cuda.device",
    "aiokv.backends.cuda.issuer",
    "aiokv.backends.cuda.host_pool",
    "aiokv.backends.cuda.pitched",
    "aiokv.backends.cuda.strategy",
    "aiokv.backends.cuda.dma",
    "aiokv.backends.cuda.kernel",
    "aiokv.backends.cuda.pieces",
    "aiokv.backends.cuda.staged",
    "aiokv.backends.cuda.planner",  # a lane's jobs planned in C (the native helper's planner)
    "aiokv.backends.cuda.completion",
    "aiokv.backends.cuda.layer_ops",  # a layerwise job's copies folded into few ops a layer
    "aiokv.backends.cuda.layer_clock",  # a measured layerwise job's device timestamps
    "aiokv.backends.cuda.layer_staging",  # layers through a device slot where blocks scatter
    "aiokv.backends.cuda.layer_copies",  # a layer's ops, and the layers a load's submit enqueues
    "aiokv.backends.cuda.layer_program",  # a layerwise job's rows for the native issuer
    "aiokv.backends.cuda.layer_issue",  # a layerwise load's enqueue, on either path
    "aiokv.backends.cuda.layer_pushes",  # a layerwise store's pushes
    "aiokv.backends.cuda.layers",
    "aiokv.backends.cuda.native_submit",  # the native path's submit (the caller only plans)
    "aiokv.backends.cuda.lane",
    "aiokv.backends.cuda.backend",
]

# The only package of the runtime whose modules may import cuda-python (the ``cuda`` package).
CUDA_PYTHON_IMPORTER = "aiokv.backends.cuda.driver"
# The one tool that calls cuda-python itself, inside a function: the bench's baseline of what
# code without aiokv writes (cuda-python's own list API), which must not go through the driver.
CUDA_PYTHON_BASELINE = "aiokv.bench.cuda_setup"


def module_name(path: Path) -> str:
    parts = ["aiokv", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, ``if TYPE_CHECKING:`` blocks included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
            modules: set[str]) -> tuple[set[str], set[str]]:
    """(aiokv modules the statement loads, top-level packages it names)."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    tops: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            tops.add(alias.name.split(".")[0])
            hit = known(alias.name)
            if hit:
                found.add(hit)
        return found, tops
    if node.level:
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    tops.add(base.split(".")[0])
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        hit = sub if sub in modules else known(base)
        if hit:
            found.add(hit)
    return found, tops


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> aiokv modules it imports, module -> top-level packages it imports)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    tops: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name], tops[name] = set(), set()
        for node in imports_in(tree):
            found, top = targets(node, name, path.name == "__init__.py", modules)
            graph[name] |= found - {name}
            tops[name] |= top
    return graph, tops


def layer_of(module: str) -> int | None:
    for floor, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return floor
    return None


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every import that runs up the house, and every module the house does not place."""
    wrong = []
    for module, imported in sorted(graph.items()):
        floor = layer_of(module)
        if floor is None:
            wrong.append(f"{module} is on no floor of LAYERS: place it")
            continue
        for other in sorted(imported):
            other_floor = layer_of(other)
            if other_floor is not None and other_floor > floor:
                wrong.append(f"{module} ({LAYERS[floor][0]}) imports {other} ({LAYERS[other_floor][0]})")
            if module in CUDA_ORDER and other in CUDA_ORDER:
                if CUDA_ORDER.index(other) > CUDA_ORDER.index(module):
                    wrong.append(f"{module} imports {other}, listed after it in CUDA_ORDER")
    return wrong


GRAPH, TOPS = import_graph()


def test_the_graph_was_read() -> None:
    assert {"aiokv", "aiokv.core", "aiokv.backends.cuda.driver", "aiokv.errors"} <= set(GRAPH)
    assert "aiokv.backends.base" in GRAPH["aiokv.core"] or "aiokv.backends" in GRAPH["aiokv.core"]
    # A lazy import inside a function counts: resolve_backend loads the CUDA backend.
    assert "aiokv.backends.cuda.backend" in GRAPH["aiokv.backends"]


def test_no_import_circle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_imports_only_point_down() -> None:
    assert upward_imports(GRAPH) == []


def test_every_cuda_module_is_in_the_cuda_order() -> None:
    cuda = {m for m in GRAPH if m == "aiokv.backends.cuda" or m.startswith("aiokv.backends.cuda.")}
    assert cuda == set(CUDA_ORDER)


def test_only_the_driver_imports_cuda_python() -> None:
    importers = sorted(m for m, tops in TOPS.items() if "cuda" in tops)
    assert importers, "the driver imports cuda-python: the graph was not read"
    driver = CUDA_PYTHON_IMPORTER
    outside = [m for m in importers
               if m != driver and not m.startswith(driver + ".") and m != CUDA_PYTHON_BASELINE]
    assert not outside, f"only {CUDA_PYTHON_IMPORTER} may import cuda-python, not {outside}"


def test_the_bench_baseline_imports_cuda_python_only_when_it_runs() -> None:
    path = ROOT / "bench" / "cuda_setup.py"
    top_level = [node for node in ast.parse(path.read_text()).body
                 if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not any("cuda" in targets(node, CUDA_PYTHON_BASELINE, False, set(GRAPH))[1] for node in top_level)


def test_type_checking_and_lazy_imports_count() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .core import OffloadCore\n"
        "def f():\n    from .core import OffloadCore\n"
    )
    found = [n for n in imports_in(tree) if isinstance(n, ast.ImportFrom) and n.module == "core"]
    assert len(found) == 2


def test_an_annotation_only_import_up_the_house_is_an_upward_arrow() -> None:
    """The circle this test once exempted (errors -> specs, for an annotation) is caught."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .specs import TransferResult\n"
    modules = {"aiokv.errors", "aiokv.specs"}
    found: set[str] = set()
    for node in imports_in(ast.parse(source)):
        found |= targets(node, "aiokv.errors", False, modules)[0]
    graph = {"aiokv.errors": found, "aiokv.specs": {"aiokv.errors"}}
    assert find_cycle(graph) == ["aiokv.errors", "aiokv.specs", "aiokv.errors"]
    assert "aiokv.errors (errors) imports aiokv.specs (vocabulary)" in upward_imports(graph)


@pytest.mark.parametrize(("graph", "complaint"), [
    ({"aiokv.errors": {"aiokv.core"}, "aiokv.core": set()}, "aiokv.errors (errors) imports aiokv.core"),
    ({"aiokv.backends.cuda.driver": {"aiokv.backends.cuda.lane"}, "aiokv.backends.cuda.lane": set()},
     "listed after it in CUDA_ORDER"),
    ({"aiokv.somewhere_new": set()}, "on no floor"),
])
def test_the_checks_can_fail(graph: dict[str, set[str]], complaint: str) -> None:
    assert any(complaint in line for line in upward_imports(graph))


def test_a_circle_is_found() -> None:
    graph = {"aiokv.a": {"aiokv.b"}, "aiokv.b": {"aiokv.c"}, "aiokv.c": {"aiokv.a"}}
    assert find_cycle(graph) == ["aiokv.a", "aiokv.b", "aiokv.c", "aiokv.a"]
    assert find_cycle({"aiokv.a": {"aiokv.b"}, "aiokv.b": set()}) is None

"""The package's layout: the import graph flows one way, every module imports on its own, and
tests mirror the modules they test.

The graph is read from the source (every `import`, also inside functions: style rule 13 says a
lower package never imports a higher one, not even lazily). Importing `a.b.c` also runs the
`__init__` of `a` and `a.b`, so those count as edges too.
"""

import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import minivllm

ROOT = Path(minivllm.__file__).parent
PACKAGE = "minivllm"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module a dotted import name lands in (`pkg.mod.Class` -> `pkg.mod`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return {n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")}


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the minivllm modules its import statements run (TYPE_CHECKING blocks too)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        own = set(_ancestors(module))
        for name in _imported_names(module, path):
            target = _resolve(name)
            if target is None or target == PACKAGE:
                continue
            for dep in [*_ancestors(target), target]:
                if dep != module and dep not in own:
                    graph[module].add(dep)
    return graph


def _top_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_graph_reader_sees_known_edges():
    graph = import_graph()
    assert "minivllm.engine.scheduler" in graph["minivllm.engine.llm_engine"]
    # importing a submodule runs its packages' __init__ first
    assert "minivllm.model_executor.layers" in graph["minivllm.model_executor.models.llama"]
    assert _cycles(["a", "b", "c"], {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]


def test_no_cycle_between_top_level_packages():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, deps in import_graph().items():
        for dep in deps:
            if _top_package(dep) != _top_package(module):
                edges[_top_package(module)].add(_top_package(dep))
    nodes = sorted({_top_package(m) for m in MODULES if m != PACKAGE})
    cycles = _cycles(nodes, edges)
    detail = {c: sorted(edges[c] & set(cycle)) for cycle in cycles for c in cycle}
    assert not cycles, f"import cycles between packages: {cycles}; edges inside them: {detail}"


# Style rule 13's order, highest first: a package may import only packages on its own row or below.
# The bottom row holds the shared pieces; the cycle test keeps those acyclic among themselves.
LAYERS = [
    ["entrypoints"],
    ["benchmarks"],
    ["engine"],
    ["worker"],
    ["lora"],
    ["model_executor", "third_party"],    # third_party: vLLM's kernel paths over minivllm's ops
    ["compilation", "config", "distributed", "v1", "forward_context", "sequence",
     "transformers_utils", "sampling_params", "pooling_params", "outputs", "logger",
     "_custom_ops", "_aiter_ops", "plugins", "envs", "platforms", "utils", "inputs",
     "beam_search", "reasoning", "logits_process",
     "triton_utils", "tasks", "multimodal"],
]


def test_imports_flow_down_the_layers():
    rank = {f"{PACKAGE}.{name}": len(LAYERS) - i for i, row in enumerate(LAYERS) for name in row}
    unknown = sorted({_top_package(m) for m in MODULES if m != PACKAGE} - set(rank))
    assert not unknown, f"packages missing from LAYERS: {unknown}"
    upward = sorted(f"{module} -> {dep}" for module, deps in import_graph().items() for dep in deps
                    if module != PACKAGE and rank[_top_package(dep)] > rank[_top_package(module)])
    assert not upward, f"imports that go up the layers: {upward}"


def test_no_cycle_between_modules():
    cycles = _cycles(sorted(MODULES), import_graph())
    assert not cycles, f"import cycles between modules: {cycles}"


# Run in a fresh interpreter with no minivllm module loaded (torch's op registry, which
# minivllm's ops join at import, cannot forget them): the heavy third-party imports happen once,
# then a forked child per module imports it from scratch, one child per core at a time (27 s of
# the default run on 2 cores when they took turns).
_IMPORT_EACH = """
import json, os, sys
import fastapi, gguf, httpx, numpy, prometheus_client, safetensors, torch, tqdm, uvicorn  # noqa
import transformers, transformers.models.llama  # noqa: F401 (shared by every child: ~10x faster)
from transformers import AutoTokenizer, LlamaConfig, PreTrainedModel  # noqa: F401
failures, running = {}, []


def reap(pid, read_fd, module):
    status = os.waitpid(pid, 0)[1]
    with os.fdopen(read_fd, "rb") as pipe:        # (a message fits the pipe's buffer)
        message = pipe.read().decode()
    if status != 0:
        failures[module] = message or "the child died"


for module in sys.argv[1:]:
    if len(running) >= (os.cpu_count() or 1):
        reap(*running.pop(0))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            __import__(module)
        except BaseException as err:
            os.write(write_fd, f"{type(err).__name__}: {err}".encode()[:4000])
            os._exit(1)
        os._exit(0)
    os.close(write_fd)
    running.append((pid, read_fd, module))
for entry in running:
    reap(*entry)
print(json.dumps(failures))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_alone():
    # An import that works only after another minivllm module was imported fails here.
    modules = sorted(m for m in MODULES if not m.endswith("__main__"))
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *modules], capture_output=True,
                          text=True, timeout=600, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, f"modules that fail to import alone: {failures}"


# Tests at the top of tests/ that are about the package as a whole, not one module.
PACKAGE_WIDE_TESTS = {"test_package_layout.py"}


def _module_for_test(test_file: Path) -> Path | None:
    """tests/<path>/test_<name>[_<aspect>].py -> minivllm/<path>/<name>(.py | .cpp | /)."""
    tests_root = Path(__file__).parent
    folder = ROOT / test_file.parent.relative_to(tests_root)
    words = test_file.stem.removeprefix("test_").split("_")
    for n in range(len(words), 0, -1):        # longest module name first
        name = "_".join(words[:n])
        for candidate in (folder / f"{name}.py", folder / f"{name}.cpp", folder / name / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def test_tests_mirror_the_package():
    tests_root = Path(__file__).parent
    orphans = sorted(str(p.relative_to(tests_root)) for p in tests_root.rglob("test_*.py")
                     if p.name not in PACKAGE_WIDE_TESTS and _module_for_test(p) is None)
    assert not orphans, ("test files that name no module (tests/<package path>/test_<module>"
                         f"[_<aspect>].py): {orphans}")
    assert _module_for_test(tests_root / "engine" / "test_llm_engine_real_model.py") == \
        ROOT / "engine" / "llm_engine.py"
    assert _module_for_test(tests_root / "engine" / "test_no_such_module.py") is None

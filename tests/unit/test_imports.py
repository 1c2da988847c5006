"""The package's import graph: its layers import only downward, no cycles, and the planner and the
CLI load no torch.

The graph has an edge from a module to every module of the package it imports, at module level or
inside a function (``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to
``a.b``). A package's ``__init__`` that its submodules' imports run first is not an edge: a module
that imports ``deepspeed_knap.planner.plan`` depends on that module, not on what
``deepspeed_knap.planner`` re-exports.
"""

import ast
import subprocess
import sys
from pathlib import Path

import deepspeed_knap

PACKAGE = Path(deepspeed_knap.__file__).parent

# The layers, bottom up (docs/design.md, "Layout"). A module is in the layer of its longest matching
# pattern: a pattern names a module and everything below it; ``*`` stands for one name. Each module
# imports only from its own layer and those below.
LAYERS = (
    ("pure: cost model, data mixes", ("deepspeed_knap.cost", "deepspeed_knap.data", "deepspeed_knap._deprecated")),
    ("planner", ("deepspeed_knap.planner",)),
    ("model catalog: specs and registry (pure)",
     ("deepspeed_knap.models.spec", "deepspeed_knap.models.registry", "deepspeed_knap.models.*.spec")),
    ("command-line parts: options, plots", ("deepspeed_knap.options", "deepspeed_knap.plots")),
    ("runtime: torch and communication", ("deepspeed_knap.runtime",)),
    ("integration: engine, generation", ("deepspeed_knap.engine", "deepspeed_knap.generation")),
    ("models", ("deepspeed_knap.models",)),
    ("training", ("deepspeed_knap.training",)),
    ("commands and benchmarks", ("deepspeed_knap.commands", "deepspeed_knap.bench")),
    ("the package and its CLI", ("deepspeed_knap", "deepspeed_knap.cli")),
)  # fmt: skip


def _matches(pattern: str, module: str) -> bool:
    parts, names = pattern.split("."), module.split(".")
    return len(names) >= len(parts) and all(p in ("*", n) for p, n in zip(parts, names, strict=False))


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (its longest matching pattern's)."""
    matches = [(len(pattern.split(".")), index) for index, (_, patterns) in enumerate(LAYERS)
               for pattern in patterns if _matches(pattern, module)]  # fmt: skip
    assert matches, f"{module} is in no layer of LAYERS"
    return max(matches)[1]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # cli imports the command modules by name at run time; the trainer's arguments import the options
    assert "deepspeed_knap.options" in graph["deepspeed_knap.training.arguments"]
    assert "deepspeed_knap.planner.problem" in graph["deepspeed_knap.planner.elastic"]
    assert "deepspeed_knap.models.flux.calibrate" in graph["deepspeed_knap.commands.calibrate"]  # in run()


def test_layers_are_assigned_by_their_longest_pattern():
    assert LAYERS[layer_of("deepspeed_knap.models.wan.spec")][0].startswith("model catalog")
    assert LAYERS[layer_of("deepspeed_knap.models.wan.wan")][0] == "models"
    assert LAYERS[layer_of("deepspeed_knap.runtime.config")][0].startswith("runtime")
    assert LAYERS[layer_of("deepspeed_knap")][0].startswith("the package")


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_only_its_layer_and_those_below():
    upward = sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {edge} ({LAYERS[layer_of(edge)][0]})"
        for module, edges in import_graph().items()
        for edge in edges
        if layer_of(edge) > layer_of(module)
    )
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_pure_layers_load_no_torch():
    """The cost model, data mixes, planner and the model catalog import without torch."""
    pure = [name for name in _modules() if layer_of(name) <= 2 and name != "deepspeed_knap"]
    code = f"import sys; import {', '.join(sorted(pure))}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", pure


def test_planner_and_cli_load_no_torch():
    """Nor does ``deepspeed-knap --help``, which imported every command (torch and DeepSpeed too, with
    DeepSpeed's accelerator warning in the help)."""
    code = (
        "import sys, deepspeed_knap, deepspeed_knap.planner, deepspeed_knap.cost.online, deepspeed_knap.cli;"
        "from deepspeed_knap.cli import main; main(['plan', '--gpus', '8', '--repeat', '1', '--json']);"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().endswith("NO TORCH")
    code = (
        "import sys\nfrom deepspeed_knap.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "generate" in result.stdout and "bench" in result.stdout, result.stdout
    assert result.stderr.strip().endswith("NO TORCH"), result.stderr

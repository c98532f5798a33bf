"""The import contract: each layer imports only layers below it, and nothing forms a cycle.

Read from the source (ast), so it needs no import-linter and runs in milliseconds. A module
counts at the layer of its top-level name under shardlm (`shardlm.zero.engine` is `zero`).
Modules in one layer are independent of each other. docs/architecture.md draws the same picture.
"""

import ast
from pathlib import Path

import shardlm

LAYERS = [  # bottom first
    {"errors"},
    {"config"},
    {"launch"},
    {"hardware"},
    {"comm"},
    {"data"},
    {"models"},
    {"checkpoint"},
    {"zero"},
    {"parallel"},
    {"planner"},
    {"train"},
    {"studies"},
    {"cli"},
    {"integrations"},  # other systems' launchers running our entry (Ray Train)
    {"__main__"},
]
PACKAGE = Path(shardlm.__file__).parent


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it where it belongs")


def _imports() -> dict[str, set[str]]:
    """shardlm module -> the shardlm modules it imports (module level or inside functions)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("shardlm"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("shardlm")}
        graph[module] = deps
    return graph


def test_every_import_points_down():
    upward = []
    for module, deps in _imports().items():
        if module == "shardlm":
            continue
        for dep in deps:
            if dep == "shardlm":
                upward.append(f"{module} imports the package root (import the module that defines it)")
            elif dep.split(".")[1] != module.split(".")[1] and _layer_of(dep) >= _layer_of(module):
                upward.append(f"{module} (layer {_layer_of(module)}) imports {dep} (layer {_layer_of(dep)})")
    assert not upward, "imports that do not point down:\n  " + "\n  ".join(sorted(upward))


def test_no_cycles_inside_a_package():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in graph.get(module, ()):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep])
                                     if dep in path else f"{module} -> {dep}")
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_the_contract_can_fail(tmp_path, monkeypatch):
    """An upward import planted in a copy of the package is caught."""
    import shutil

    copy = tmp_path / "shardlm"
    shutil.copytree(PACKAGE, copy)
    (copy / "config/schema.py").write_text((copy / "config/schema.py").read_text() + "\nfrom shardlm.train.loop import train\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    try:
        test_every_import_points_down()
    except AssertionError as e:
        assert f"shardlm.config.schema (layer {_layer_of('shardlm.config')}) imports shardlm.train.loop" in str(e)
    else:
        raise AssertionError("the planted upward import was not reported")

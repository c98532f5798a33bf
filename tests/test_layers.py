"""The import contract: each layer imports only layers below it, and nothing forms a cycle.

Read from the source (ast), so it needs no import-linter and runs in milliseconds. A module
counts at the layer of its top-level name under shardlm (`shardlm.parallel.data.zero.engine` is
`parallel`), but for the few PINNED below their package: torch-free modules that live with their
axis and are read by a lower layer. Modules in one layer are independent of each other.
docs/architecture.md draws the same picture.
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
    {"parallel"},
    {"planner"},
    {"train"},
    {"studies"},
    {"cli"},
    {"integrations"},  # other systems' launchers running our entry (Ray Train)
    {"__main__"},
]
PACKAGE = Path(shardlm.__file__).parent
PINNED = {  # module -> the layer it sits at, below its package's
    "shardlm.parallel.pipeline.tables": "config",  # schedules as data, no torch: config's rules read them
    "shardlm.parallel.pipeline.schedules": "config",
}


def _layer_of(module: str) -> int:
    top = PINNED.get(module) or (module.split(".")[1] if "." in module else "")
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


def _same_room(a: str, b: str) -> bool:
    """One package (a pinned module counts in the package of its layer): its modules import each
    other freely (test_no_cycles_inside_a_package)."""
    return (PINNED.get(a) or a.split(".")[1]) == (PINNED.get(b) or b.split(".")[1])


def test_every_import_points_down():
    upward = []
    for module, deps in _imports().items():
        if module == "shardlm":
            continue
        for dep in deps:
            if dep == "shardlm":
                upward.append(f"{module} imports the package root (import the module that defines it)")
            elif not _same_room(dep, module) and _layer_of(dep) >= _layer_of(module):
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


def test_pinned_modules_stay_light():
    """A pinned module is imported by its lower layer through its package's __init__s: they
    import nothing, and it imports no torch (config is torch-free at import)."""
    for module in PINNED:
        parts = module.split(".")
        for i in range(2, len(parts)):
            init = PACKAGE.parent.joinpath(*parts[:i], "__init__.py")
            assert not [n for n in ast.parse(init.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))], \
                f"{init} imports something: {module} is read by the {PINNED[module]} layer through it"
        tree = ast.parse(PACKAGE.parent.joinpath(*parts).with_suffix(".py").read_text())
        tops = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        tops |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in tops, f"{module} imports torch, but the {PINNED[module]} layer reads it"


MAX_FUNCTION_LINES = 80


def _long_functions(package: Path) -> dict[str, int]:
    """'module:Class.function' -> its lines (end_lineno - lineno + 1: from `def`, decorators
    excluded) for every function or method in `package` over MAX_FUNCTION_LINES, nested ones
    included."""
    long = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    lines = child.end_lineno - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                        long[f"{module}:{name}"] = lines
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text()), "")
    return long


def test_no_long_functions():
    """No function or method in src/ is over 80 lines (issue 45): one that grows past it is split
    into helpers that each do one thing."""
    over = _long_functions(PACKAGE)
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (split them by purpose):\n  "
                      + "\n  ".join(f"{k}: {v}" for k, v in sorted(over.items())))


def test_long_functions_are_found(tmp_path):
    """A function of 81 lines (a method, decorated: the decorator not counted) is reported; one
    of 80 is not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(79))  # def + 79 = 80 lines
    src = (f"class A:\n    @staticmethod\n    def fits():\n{body}\n\n"
           f"    def long():\n{body}\n        return x0\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(src)
    assert _long_functions(tmp_path / "pkg") == {"pkg.mod:A.long": 81}


def test_the_contract_can_fail(tmp_path, monkeypatch):
    """An upward import planted in a copy of the package is caught, in a pinned module too."""
    import shutil

    copy = tmp_path / "shardlm"
    shutil.copytree(PACKAGE, copy)
    (copy / "config/schema.py").write_text((copy / "config/schema.py").read_text() + "\nfrom shardlm.train.loop import train\n")
    tables = copy / "parallel/pipeline/tables.py"
    tables.write_text(tables.read_text() + "\nfrom shardlm.parallel.pipeline.stages import Stage\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    try:
        test_every_import_points_down()
    except AssertionError as e:
        assert f"shardlm.config.schema (layer {_layer_of('shardlm.config')}) imports shardlm.train.loop" in str(e)
        assert (f"shardlm.parallel.pipeline.tables (layer {_layer_of('shardlm.config')}) imports "
                f"shardlm.parallel.pipeline.stages (layer {_layer_of('shardlm.parallel')})") in str(e)
    else:
        raise AssertionError("the planted upward import was not reported")


def _forwarding_modules(package: Path) -> list[str]:
    """Modules that only pass on names defined elsewhere (issue 45: no shims): a body of nothing
    but imports, `__all__` and a docstring, with at least one `from ... import`, or a
    module-level `__getattr__` (a lazy re-export, PEP 562)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        rest = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                and not (isinstance(s, ast.ImportFrom) and s.module == "__future__")]
        imports = [s for s in rest if isinstance(s, ast.ImportFrom)]
        only = all(isinstance(s, (ast.Import, ast.ImportFrom)) or (isinstance(s, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets)) for s in rest)
        lazy = any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in body)
        if (imports and only) or lazy:
            found.append(path.relative_to(package.parent).as_posix())
    return found


def test_no_module_only_re_exports(tmp_path):
    """Every name is imported from the module that defines it; a package's __init__ says what
    is inside, it does not forward (checked to find both kinds in a planted package)."""
    assert _forwarding_modules(PACKAGE) == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""Doc."""\nfrom pkg.a import f\n__all__ = ["f"]\n')
    (tmp_path / "pkg" / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    (tmp_path / "pkg" / "a.py").write_text("from os import path\n\ndef f():\n    return path\n")
    assert _forwarding_modules(tmp_path / "pkg") == ["pkg/__init__.py", "pkg/lazy.py"]

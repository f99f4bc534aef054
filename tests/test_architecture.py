"""Imports run one way: each package of frugality imports only packages of the layers below
its own (function-level imports included), as docs/architecture.md draws them; no two
modules import each other, even through others; benchmarks import only public names."""

import ast
from pathlib import Path

import frugality

# Top to bottom; a package may import its own modules and any package of a lower layer.
LAYERS = (
    ("cli",),
    ("bench", "serve"),
    ("training", "inference"),
    ("runtime", "health"),
    ("compile", "distributed", "interop", "tasks"),
    ("precision", "metrics"),
    ("kernels",),
    ("config", "checkpoint", "data"),
    ("models", "hardware"),
    ("backends",),
    ("xla",),
    ("paths",),
    ("errors", ""),  # "": the root package (frugality.__version__)
)
ROOT = Path(frugality.__file__).parent
REPO = ROOT.parent.parent


def _layer(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"package frugality.{package} is in no layer of this test and docs/architecture.md")


def _imports(path: Path):
    """(line, imported frugality module) for every import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "frugality":
                yield from ((node.lineno, f"frugality.{a.name}") for a in node.names)
            elif node.module.startswith("frugality."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("frugality."))


def _package(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    return "" if name == "__version__" else name


def test_every_import_goes_down_the_layers():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        here = (
            relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.name != "__init__.py" else ""
        )
        here = "cli" if here == "__main__" else here  # `python -m frugality` is the CLI
        for line, module in _imports(path):
            there = _package(module)
            if there != here and _layer(there) <= _layer(here):
                wrong.append(f"{relative}:{line} (frugality.{here or '__init__'}) imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_benchmarks_import_only_public_names():
    private = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("frugality"):
                private += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in _frugality_names(tree)
            ):
                private.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not private, "private names used by benchmarks:\n" + "\n".join(private)


def _frugality_names(tree) -> set[str]:
    """Names bound to frugality modules by `from frugality... import x [as y]`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("frugality"):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_the_layers_are_documented():
    """docs/architecture.md draws the same layers, top to bottom, as `names | what` lines."""
    text = (REPO / "docs" / "architecture.md").read_text()
    diagram = text.split("```\n", 2)[1]
    drawn = [tuple(line.split("|")[0].split()) for line in diagram.splitlines() if "|" in line]
    assert drawn == [tuple(p for p in layer if p) for layer in LAYERS]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _module_graph() -> dict[str, set[str]]:
    """Each frugality module and the frugality modules it imports (at any depth, typing-only
    imports included): `from frugality.a import b` is the module a.b where there is one, else
    the package a. (A package imported first by Python because a submodule of it is, is not
    an edge: that is no cycle. Relative imports are refused: they would be unseen here.)"""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}:{node.lineno}: a relative import"
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "frugality":
                    for a in node.names:
                        target = f"{node.module}.{a.name}"
                        graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
        graph[name] = {t for t in graph[name] if t in modules and t != name}
    return graph


def test_no_two_modules_import_each_other_even_through_others():
    """No import cycle between modules, inside a package too (the layer test sees packages):
    each strongly connected part of the module graph is one module."""
    graph = _module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(" <-> ".join(sorted(part)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert "frugality.compile.base" in graph.get("frugality.compile.session", ())  # the graph is read
    assert sum(map(len, graph.values())) > 300
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)

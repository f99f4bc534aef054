"""Imports run one way: each package of frugality imports only packages of the layers below
its own (function-level imports included), as docs/architecture.md draws them; benchmarks
import only public names."""

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

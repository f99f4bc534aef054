"""Every test marked `cuda` has a CPU twin that CI runs: the mark sits on a `pytest.param` of a
device parameter beside a CPU one, never on the whole function (whose body CI would then
never run, so that a change of contract shows only on the next GPU machine)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_cuda_mark(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node).endswith("mark.cuda")


def _params(decorator: ast.AST, names: dict[str, ast.AST]) -> list[ast.AST]:
    """The values of a `pytest.mark.parametrize(...)` decorator's list of cases (held in the
    call, or in a module-level name)."""
    if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.parametrize")):
        return []
    cases = decorator.args[1] if len(decorator.args) > 1 else None
    cases = next((k.value for k in decorator.keywords if k.arg == "argvalues"), cases)
    if isinstance(cases, ast.Name):
        cases = names.get(cases.id)
    return list(cases.elts) if isinstance(cases, ast.List | ast.Tuple) else []


def _module_names(tree: ast.Module) -> dict[str, ast.AST]:
    """The module's top-level `NAME = value` assignments."""
    return {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _cuda(node: ast.AST, aliases: set[str]) -> bool:
    """Whether `node` holds the cuda mark, itself or through a name standing for it."""
    return any(_is_cuda_mark(n) or (isinstance(n, ast.Name) and n.id in aliases) for n in ast.walk(node))


def _marked_cuda(case: ast.AST, aliases: set[str]) -> bool:
    return isinstance(case, ast.Call) and any(k.arg == "marks" and _cuda(k.value, aliases) for k in case.keywords)


def cuda_tests_without_twins(folder: Path = TESTS) -> list[str]:
    lonely = []
    for path in sorted(folder.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = _module_names(tree)
        marks = names.get("pytestmark")
        # a module marked cuda as a whole, or a name standing for the mark (`needs_gpu = pytest.mark.cuda`)
        if marks is not None and any(_is_cuda_mark(n) for n in ast.walk(marks)):
            lonely.append(f"{path.relative_to(folder)}::pytestmark")
        aliases = {name for name, value in names.items() if _is_cuda_mark(value)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):  # a class marked as a whole, by decorator or pytestmark
                own = [
                    v.value
                    for v in node.body
                    if isinstance(v, ast.Assign) and "pytestmark" in map(ast.unparse, v.targets)
                ]
                if any(_cuda(d, aliases) for d in [*node.decorator_list, *own]):
                    lonely.append(f"{path.relative_to(folder)}::{node.name}")
                continue
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test"):
                continue
            where = f"{path.relative_to(folder)}::{node.name}"
            if any(_is_cuda_mark(d) or (isinstance(d, ast.Name) and d.id in aliases) for d in node.decorator_list):
                lonely.append(where)
                continue
            for decorator in node.decorator_list:
                cases = _params(decorator, names)
                marked = [_marked_cuda(c, aliases) for c in cases]
                if any(marked) and all(marked):
                    lonely.append(where)
    return lonely


def test_every_cuda_test_has_a_cpu_twin():
    assert cuda_tests_without_twins() == []


def test_a_test_marked_cuda_as_a_whole_is_found(tmp_path):
    (tmp_path / "test_gpu.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_alone():\n    pass\n\n"
        '@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda)])\n'
        "def test_no_cpu_case(device):\n    pass\n\n"
        '@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])\n'
        "def test_twinned(device):\n    pass\n\n"
        'GPU_ONLY = [pytest.param("cuda", marks=pytest.mark.cuda)]\n'
        "needs_gpu = pytest.mark.cuda\n\n"
        '@pytest.mark.parametrize("device", GPU_ONLY)\n'
        "def test_cases_in_a_name(device):\n    pass\n\n"
        "@needs_gpu\ndef test_an_alias():\n    pass\n\n"
        '@pytest.mark.parametrize("d", argvalues=[pytest.param("cuda", marks=needs_gpu)])\n'
        "def test_an_alias_in_a_case(d):\n    pass\n\n"
        "class TestOnTheGpu:\n    pytestmark = needs_gpu\n\n    def test_inside(self):\n        pass\n"
    )
    (tmp_path / "test_module.py").write_text("import pytest\n\npytestmark = [pytest.mark.cuda]\n")
    assert cuda_tests_without_twins(tmp_path) == [
        "test_gpu.py::test_alone",
        "test_gpu.py::test_no_cpu_case",
        "test_gpu.py::test_cases_in_a_name",
        "test_gpu.py::test_an_alias",
        "test_gpu.py::test_an_alias_in_a_case",
        "test_gpu.py::TestOnTheGpu",
        "test_module.py::pytestmark",
    ]

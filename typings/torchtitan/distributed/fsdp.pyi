# torchtitan: a CUDA-only peer of `bench train`, not in .venv: untyped for pyright (pyproject.toml [tool.pyright]).
from _typeshed import Incomplete

def __getattr__(name: str) -> Incomplete: ...

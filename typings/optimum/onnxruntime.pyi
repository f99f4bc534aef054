# optimum: `bench infer`'s peer, in a venv of its own: untyped for pyright (pyproject.toml [tool.pyright]).
from _typeshed import Incomplete

def __getattr__(name: str) -> Incomplete: ...

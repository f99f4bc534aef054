# torch_xla lives in .venv-xla (scripts/setup.sh --xla): untyped for pyright (pyproject.toml [tool.pyright]).
from _typeshed import Incomplete

def __getattr__(name: str) -> Incomplete: ...

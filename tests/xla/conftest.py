"""The XLA tests run in .venv-xla (torch 2.9.0 + torch-xla 2.9.0, `./scripts/setup.sh --xla`)
on XLA's CPU client: tests/test_xla_environment.py runs them from the main suite. Where
torch_xla is not installed (the main environment) they are not collected."""

import importlib.util
import os

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla opens a client

"""PyTorch/XLA: the stack of AWS Trainium and Inferentia (torch-neuronx is PyTorch/XLA with a
Neuron plugin) and of TPUs; XLA's CPU client (`PJRT_DEVICE=CPU`) runs the same code on any
machine, which is how frugality's XLA path is tested.

What frugality asks of it, and nothing more: the device, the cut that ends a step's graph
(`sync`, XLA's `mark_step`), the count of graphs compiled (for the recompilation guard),
and what the PJRT client is. torch_xla is imported only when a run names an XLA device, and
only from here; it pairs with one torch version (torch-xla 2.9.0 with torch 2.9.0:
`./scripts/setup.sh --xla` makes that environment, `.venv-xla`). A bad set-up is one line.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from frugality.errors import UserError

ENV = "PJRT_DEVICE"  # which PJRT client torch_xla opens: CPU, TPU, NEURON, CUDA
SETUP = "./scripts/setup.sh --xla (a .venv-xla with torch 2.9.0 and torch-xla 2.9.0)"


def requested() -> bool:
    """Whether this process was started for XLA: `PJRT_DEVICE` is set."""
    return bool(os.environ.get(ENV))


def installed() -> bool:
    """Whether torch_xla can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


_SPMD: list[bool] = []  # asked for before the client opened: one process, every device


def use_spmd() -> None:
    """Run this process's XLA work as SPMD over every device of the client: to be asked for
    before the client opens (torch_xla cannot switch an opened client: it crashes)."""
    if load.cache_info().currsize and not _SPMD:
        raise UserError("parallel.spmd: this process opened its XLA device without SPMD; start a new process")
    _SPMD[:] = [True]


def spmd() -> bool:
    return bool(_SPMD)


@cache
def load():
    """torch_xla, imported; a missing or mismatched installation, or a `PJRT_DEVICE` naming a
    device that is not there, is one UserError."""
    if not installed():
        raise UserError(f"an xla device needs torch_xla, which this environment lacks; {SETUP}")
    # Python scalars equal to 0 or 1 (a clip scale of exactly 1) would otherwise be baked into
    # the graph as constants: a new graph, compiled mid-run, the first time a value reaches one.
    os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
    try:
        import torch_xla
        import torch_xla.debug.metrics  # noqa: F401 - the compile counters
        import torch_xla.runtime  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:
        raise UserError(
            f"torch_xla does not import with torch {torch.__version__} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}); torch_xla pairs with one torch version: {SETUP}"
        ) from None
    if not requested():
        os.environ[ENV] = "CPU"  # torch_xla would guess, and warn; the CPU client is what runs anywhere
    if hasattr(torch_xla._XLAC, "_set_xla_enable_device_data_cache"):
        # XLA shares one device buffer among equal scalars: two inputs of a step that happen to
        # be equal (AdamW's bias correction reaching 1.0 beside a clamp's 1.0, at step 325)
        # would become one, and the step's graph another, compiled mid-run
        torch_xla._XLAC._set_xla_enable_device_data_cache(False)
    try:
        if _SPMD:
            torch_xla.runtime.use_spmd()
        torch_xla.device()
    except Exception as e:  # noqa: BLE001 - any PJRT client failure is the user's device set-up
        raise UserError(
            f"{ENV}={os.environ.get(ENV)!r}: torch_xla cannot open that device here ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}); PJRT_DEVICE=CPU runs XLA's CPU client on any machine"
        ) from None
    return torch_xla


def device() -> torch.device:
    """The process's XLA device (`xla:0`)."""
    return torch.device(load().device())


def sync() -> None:
    """End the graph traced so far: XLA compiles it (once per distinct graph) and runs it."""
    load().sync()


def wait() -> None:
    """Block until the device has run everything dispatched (for timing)."""
    import torch_xla.core.xla_model as xm

    load()
    xm.wait_device_ops()


def compilations() -> int:
    """Graphs XLA has compiled in this process so far (its CompileTime metric's count)."""
    data = load().debug.metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def compile_seconds() -> float:
    """Seconds XLA has spent compiling graphs in this process so far."""
    data = load().debug.metrics.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0  # its accumulator counts nanoseconds


def client() -> str:
    """The PJRT device kind: CPU, TPU, NEURON, CUDA."""
    return str(load().runtime.device_type())


def version() -> str:
    return str(load().__version__)


# PJRT clients whose executables torch_xla's persistent cache loads back. None with
# torch_xla 2.9: the CPU client cannot deserialize them, nor can TPU (pytorch/xla #9094,
# still open at 2.9.0; the fix, #9759, unmerged) or CUDA (#8930); Neuron's compiler keeps its
# own cache (NEURON_COMPILE_CACHE_URL). `compile.xla_executables = "on"` stores them anyway.
SERIALIZES: tuple[str, ...] = ()


def requested_client() -> str:
    """The PJRT client `PJRT_DEVICE` asks for (CPU when unset), without opening it."""
    return (os.environ.get(ENV) or "CPU").upper()


def kind() -> str:
    """The device's generation where the client tells it (a TPU's version), else the client."""
    name = client()
    if name == "TPU":
        try:
            from torch_xla._internal import tpu

            return f"TPU v{tpu.version()}"  # from the metadata server
        except Exception:  # noqa: BLE001 - the client kind alone then keys the entry
            return name
    if name == "CUDA":
        props = torch.cuda.get_device_properties(0)
        return f"CUDA {props.name} {props.major}.{props.minor}"
    return name


def open_executable_cache(path: str) -> bool:
    """Have XLA keep the executables it compiles under `path`, and look there before
    compiling (torch_xla's persistent cache). Only before this process compiles its first
    graph: False (nothing changed) after."""
    torch_xla = load()
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        return False
    torch_xla.runtime.initialize_cache(path, readonly=False)
    return True


def persistent_cache_hits() -> int:
    """Graphs loaded from the persistent cache instead of compiled, in this process."""
    return int(load().debug.metrics.counter_value("PersistentCacheHit") or 0)


def persistent_cache_misses() -> int:
    """Graphs compiled and written to the persistent cache, in this process."""
    return int(load().debug.metrics.counter_value("PersistentCacheMiss") or 0)


def persistent_cache_unloadable() -> int:
    """Graphs found in the persistent cache that this client could not load (the CPU client)."""
    return int(load().debug.metrics.counter_value("PersistentCacheDeserializeFailure") or 0)


def device_count() -> int:
    """The devices of the PJRT client (with SPMD, the one `device()` stands for all of them)."""
    return int(load().runtime.global_runtime_device_count())


@cache
def mesh():
    """SPMD's mesh: every device of the client along one axis, "data"."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    load()
    count = device_count()
    return xs.Mesh(np.arange(count), (count,), ("data",))


def shard(tensor: torch.Tensor, first: bool = True) -> torch.Tensor:
    """Annotate an XLA tensor (SPMD): its first dimension split over the mesh's devices, or,
    with `first=False`, whole on each (replicated)."""
    import torch_xla.distributed.spmd as xs

    spec = (("data" if first else None),) + (None,) * (tensor.dim() - 1)
    return xs.mark_sharding(tensor, mesh(), spec)


_XLA_TYPES = {torch.int32: "S32", torch.float32: "F32", torch.int16: "S16", torch.bfloat16: "BF16"}


@cache
def _bitcast_op():
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_op_registry as registry

    return registry.register("frugality_bitcast", lambda x, to: x.bitcast(getattr(xb.Type, to)))


def bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x`'s bits read as `dtype` (of the same width), traced into the graph: torch's
    `view(dtype)` of a tensor not yet computed would run the graph so far, splitting a step."""
    load()
    return _bitcast_op()(x, to=_XLA_TYPES[dtype])


def parallel_loader(steps, prefetch: int):
    """torch_xla's `ParallelLoader` over an iterable of steps (each a list of CPU tensors):
    a thread reads steps ahead and another copies them to the device (split by rows over
    the mesh with SPMD), while the device runs the step before. Its queues hold `prefetch`
    steps each: up to about 3 x `prefetch` + 1 steps are read ahead.
    Returns (an iterator of the steps on the device, a function that stops both threads)."""
    import torch_xla.distributed.parallel_loader as pl

    load()
    sharding = None
    if spmd():
        import torch_xla.distributed.spmd as xs

        sharding = xs.ShardingSpec(mesh(), ("data", None))  # the rows of each micro-batch
    loader = pl.ParallelLoader(
        steps, [device()], loader_prefetch_size=prefetch, device_prefetch_size=prefetch, input_sharding=sharding
    )
    return iter(loader.per_device_loader(device())), loader.close

"""Training across processes on PyTorch's own distributed engine: torchrun (or
`torch.distributed.run`) starts the processes, c10d's process group connects them (gloo on
CPUs, NCCL on CUDA GPUs), and the data-parallel strategy wraps the specialized model from
outside (`wrap`). One process without torchrun's environment is world size 1: nothing is
initialised and nothing is wrapped.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as launch
from torch.nn.parallel import DistributedDataParallel

from frugality.backends import backend
from frugality.config.recipe import ParallelConfig
from frugality.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    devices: int = 1  # the devices each process drives: SPMD's, all of its XLA client's
    tensor: int = 1  # tensor-parallel degree: groups of this many consecutive ranks share each batch
    pipeline: int = 1  # pipeline-parallel degree: the stages, each on its own rank, share each batch too

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks (those that read different batches)."""
        return self.rank // (self.tensor * self.pipeline)

    @property
    def data_size(self) -> int:
        """The data-parallel ranks: the processes over the tensor- and pipeline-parallel degrees."""
        return self.world_size // (self.tensor * self.pipeline)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


LAUNCHER_ENV = "FRUGALITY_LAUNCHER_PID"


def launch_local(nproc: int, args: list[str], shutdown_timeout_s: int | None = None) -> int:
    """`frugality ARGS` in `nproc` processes on this machine, started by torchrun's own
    launcher (`torch.distributed.run`, standalone rendezvous); the exit status of the
    first failed rank, named on one line, or 0; 130 when a signal stopped the ranks (they
    were given `shutdown_timeout_s`, torchrun's 30 s by default, to save their checkpoint
    before SIGKILL). Each rank gets this machine's cores shared out (OMP_NUM_THREADS,
    unless set) and ends with the launcher if it dies (`follow_launcher`)."""
    timeout = [f"--shutdown-timeout={shutdown_timeout_s}"] if shutdown_timeout_s else []
    config = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", *timeout, "-m", "frugality"])
    config.training_script_args = list(args)  # not through torchrun's parser: --nproc would read as its own
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", LAUNCHER_ENV)}
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.ERROR)  # its notes on forwarding a Ctrl-C, and the per-rank failure dump
    try:
        launch(config)
    except SignalException:  # Ctrl-C or SIGTERM: torchrun passed it to the ranks and waited for them
        return 130
    except ChildFailedError as e:
        # The rank that failed first, by what it says: one killed by a signal other than the
        # launcher's SIGTERM (the OOM killer, a lost node), else one that exited of its own
        # accord; the others' SIGTERM is usually the launcher tearing them down after it.
        failures = sorted(e.failures.items())
        rank, failure = next(
            ((r, f) for r, f in failures if f.exitcode < 0 and f.exitcode != -signal.SIGTERM),
            next(((r, f) for r, f in failures if f.exitcode > 0), failures[0]),
        )
        if failure.exitcode == 130:  # stopped by a signal after a checkpoint: rank 0 said so
            return 130
        if failure.exitcode < 0:
            print(f"error: rank {rank} of {nproc} was killed by signal {-failure.exitcode}", file=sys.stderr)
            return 128 - failure.exitcode  # as a shell reports it
        print(f"error: rank {rank} of {nproc} failed with exit status {failure.exitcode}", file=sys.stderr)
        return failure.exitcode
    finally:
        elastic.setLevel(level)
        for name, value in saved.items():  # this process goes on (doctor): as it was
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


def follow_launcher() -> None:
    """In a rank that `launch_local` started: ask the kernel for SIGKILL when the launcher
    dies (killed by the OOM killer, kill -9), so that no rank is left behind. Not SIGTERM:
    a rank stopping after its step waits in collectives for ranks that may be gone already,
    up to parallel.timeout_s; as after a lost node, the run resumes from its last checkpoint
    (`--retries` does it). The variable is consumed, so processes the rank starts do not
    take it for theirs. Linux only."""
    launcher = os.environ.pop(LAUNCHER_ENV, None)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)


def world_from_env() -> World:
    """This process's place, from the variables torchrun sets (world size 1 without them)."""
    try:
        return World(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None


def init(device: torch.device, timeout_s: int) -> World:
    """Join the process group torchrun describes (once per process); CUDA ranks take the GPU
    of their local rank. A collective that waits longer than `timeout_s` fails instead of
    hanging."""
    world = world_from_env()
    if world.distributed and not dist.is_initialized():
        kind = backend(device)
        kind.join(world.local_rank)
        dist.init_process_group(kind.process_group, timeout=datetime.timedelta(seconds=timeout_s))
        _JOINED.append(True)
    return world


def local_device(device: torch.device, world: World) -> torch.device:
    """The device this rank trains on: its own GPU on a multi-GPU machine."""
    return backend(device).local_device(world.local_rank, world.distributed)


def wrap(module: nn.Module, blocks, parallel: ParallelConfig, world: World, device: torch.device) -> nn.Module:
    """`module` (a task's training module) as the strategy trains it, unchanged at world
    size 1; `blocks` are the model's transformer blocks inside it:
    - ddp: a wrapper whose backward all-reduces gradient buckets while earlier layers still
      compute;
    - fsdp: FSDP2 in place, `fully_shard` on each block, then the root: each rank keeps 1/N
      of every parameter, gradient and optimizer state, and gathers a block's parameters
      just before the block runs;
    - hsdp: the same within groups of `parallel.shard_size` ranks, the groups replicas of
      each other (gradients reduce-scattered in the group, then all-reduced across groups)."""
    if not world.distributed or world.data_size == 1:  # tensor parallel alone: nothing more to wrap
        return module
    if parallel.data == "ddp" and world.tensor == 1:
        ids = [device.index] if backend(device).device_per_rank else None
        # the models' buffers are constant tables (rotary): no broadcast of them every forward
        return DistributedDataParallel(module, device_ids=ids, forward_sync_buffers=False)
    mesh = data_parallel_mesh(parallel, world, device)
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        # the last block's parameters are the first that backward needs: keep them gathered
        fully_shard(block, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward and i < len(blocks) - 1)
    # the root: embeddings, final norm, output layer, the task's parameters (fully_shard returns
    # `module` itself, its class now also an FSDPModule)
    return cast(nn.Module, fully_shard(module, mesh=mesh))


def data_parallel_mesh(parallel: ParallelConfig, world: World, device: torch.device) -> DeviceMesh:
    """fsdp: one dimension over every rank; hsdp: (replicas, shard group) with groups of
    `parallel.shard_size` consecutive ranks (by default a node's processes, so that the
    frequent all-gathers stay inside a node). With tensor parallel, the data-parallel part
    of the world's mesh (`world_mesh`): ddp there is FSDP2's replication (shard groups of one)."""
    if world.tensor > 1 or world.pipeline > 1:
        return world_mesh(parallel, world, device)["replicate", "shard"]
    if parallel.data == "fsdp":
        return init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("shard",))
    shard = shard_group_size(parallel, world)
    if world.world_size % shard:
        raise UserError(f"parallel.shard_size {shard}: must divide the number of processes ({world.world_size})")
    return init_device_mesh(device.type, (world.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def world_mesh(parallel: ParallelConfig, world: World, device: torch.device) -> DeviceMesh:
    """The mesh of a run with tensor or pipeline parallel: ("replicate", "shard",
    "pipeline", "tensor"), tensor innermost (consecutive ranks: within a node), then the
    pipeline stages, data parallel over the rest as `parallel.data` says (ddp: all
    replicas; fsdp: all one shard group; hsdp: both)."""
    dp = world.data_size
    if parallel.data == "ddp":
        shape = (dp, 1)
    elif parallel.data == "fsdp":
        shape = (1, dp)
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
        shard = parallel.shard_size or max(1, local // (world.tensor * world.pipeline))
        if dp % shard:
            raise UserError(f"parallel.shard_size {shard}: must divide the data-parallel ranks ({dp})")
        shape = (dp // shard, shard)
    return _mesh(device.type, (*shape, world.pipeline, world.tensor), ("replicate", "shard", "pipeline", "tensor"))


_MESHES: dict = {}


def _mesh(device_type: str, shape: tuple, names: tuple) -> DeviceMesh:
    """One mesh (and one set of process groups) per shape in a process."""
    key = (device_type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def shard_group_size(parallel: ParallelConfig, world: World) -> int:
    """hsdp: ranks per shard group, `parallel.shard_size` or the processes of a node."""
    return parallel.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))


def describe(parallel: ParallelConfig, world: World) -> str:
    """The strategy as the run header states it."""
    if world.pipeline > 1:
        rest = f" x tensor parallel {world.tensor}" if world.tensor > 1 else ""
        rest += f" x {parallel.data} {world.data_size}" if world.data_size > 1 else ""
        return f"pipeline parallel {world.pipeline}{rest} over {world.world_size} processes"
    if world.tensor > 1:
        if world.data_size == 1:
            return f"tensor parallel {world.tensor} over {world.world_size} processes"
        return f"{parallel.data} {world.data_size} x tensor parallel {world.tensor} over {world.world_size} processes"
    text = f"{parallel.data} over {world.world_size} processes"
    if parallel.data == "hsdp":
        shard = shard_group_size(parallel, world)
        text += f" ({world.world_size // shard} replicas of {shard}-rank shard groups)"
    return text


@contextmanager
def no_sync(model: nn.Module):
    """Backward inside accumulates gradients on each rank without communicating (the
    micro-batches of an accumulated step before the last)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def all_mean(value: float, device: torch.device) -> float:
    """The mean of a number over the ranks (itself at world size 1)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def all_min(value: float, device: torch.device) -> float:
    """The least of a number over the ranks (itself at world size 1)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Each number summed over the ranks (as given at world size 1)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's CPU tensor concatenated along dim 0, in rank order (row counts may
    differ). Small tensors only: it goes through pickled objects on the default group."""
    if not dist.is_initialized():
        return rows
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return torch.cat(cast(list[torch.Tensor], gathered))  # filled in by all_gather_object


class _GatherWithGrad(torch.autograd.Function):
    """Every rank's rows, stacked in rank order; the gradient of this rank's rows is the sum
    of every rank's gradient for them (each rank's loss reaches every rank's rows)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(), rows.shape[0]
        out = rows.new_empty((dist.get_world_size() * rows.shape[0], *rows.shape[1:]))
        dist.all_gather_single(out, rows.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: never autograd's own
        dist.all_reduce(grad)  # a reduce-scatter, on every backend (gloo has none); the rows are few
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def gather_with_grad(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's `rows` (the same shape on each) stacked in rank order, differentiable,
    and this rank's index among them; `rows` and 0 outside a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows, 0
    return _GatherWithGrad.apply(rows), dist.get_rank()


def barrier() -> None:
    """Wait for every rank (nothing at world size 1)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group, where one was joined (at the end of a command)."""
    _MESHES.clear()  # their process groups go with it
    if dist.is_initialized():
        dist.destroy_process_group()


_JOINED: list[bool] = []  # a process group was joined in this process


def joined() -> bool:
    """Whether this process joined a process group (it is a rank of a torchrun job)."""
    return bool(_JOINED)


def exit_process(status: int) -> None:
    """End a process that joined a process group with `status`, once its command returned:
    the exit handlers run and the output is flushed, but the interpreter's own teardown is
    skipped. Gloo's worker threads outlive `destroy_process_group` once DTensor or FSDP2
    collectives ran (torch 2.13), and their destruction at that teardown aborts the process
    now and then ("terminate called without an active exception", SIGABRT) after a run that
    succeeded, which torchrun reports as a failed run (pytorch/pytorch#190489). Nothing
    where no group was joined (one process; tests calling the CLI in-process). What the
    teardown would also have done is skipped: joining non-daemon threads (the commands close
    their loggers, TensorBoard writers and checkpoint threads before they return) and
    flushing C stdio buffers."""
    if not _JOINED:
        return
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(status)

"""One backend per device kind: what each says, and that code outside the backends (and
`hardware`'s probes, `kernels/`) asks them rather than comparing `device.type`."""

import ast
from pathlib import Path

import torch

import frugality
from frugality.backends import CpuBackend, CudaBackend, OtherBackend, XlaBackend, backend
from frugality.hardware import device_memory
from frugality.metrics.memory import peak_memory_bytes

SRC = Path(frugality.__file__).parent
# where comparing a device's kind is the point: the backends, the probes, device-specific kernels
KIND_CODE = ("backends/", "hardware.py", "kernels/")
# the others left, each for a reason (file, kind, how many): a tensor on the meta device (no
# data to read); the peers' own CUDA-only recipe (liger-kernel, torchtitan; as their authors run them)
ALLOWED = {("tasks/masked_lm.py", "meta"): 1, ("bench/peers.py", "cuda"): 2}


def test_each_kind_has_its_backend_and_says_what_holds_for_it():
    cpu, cuda, xla = backend("cpu"), backend(torch.device("cuda", 1)), backend("xla")
    assert (type(cpu), type(cuda), type(xla)) == (CpuBackend, CudaBackend, XlaBackend)
    assert cuda.device == torch.device("cuda", 1)
    assert (cpu.process_group, cuda.process_group, xla.process_group) == ("gloo", "nccl", "gloo")
    assert cpu.on_host and cpu.host_memory and cpu.c_kernels and not cpu.traced
    assert cuda.device_per_rank and not cuda.on_host and not cuda.host_memory and not cuda.c_kernels
    assert xla.traced and xla.one_process and xla.initialises_on_host
    assert not (xla.model_parallel or xla.recomputes or xla.fused_optimizer or xla.plans_memory)
    assert xla.generator_device() == torch.device("cpu")  # draws on the host, as a CPU does
    assert cpu.local_device(3, True) == torch.device("cpu")
    assert cuda.local_device(3, True) == torch.device("cuda", 3) and cuda.local_device(3, False) == cuda.device
    assert cpu.compute_capability() is None and xla.local_count() is None and cpu.local_count() >= 1
    # and what does not hold, kind by kind
    assert not (cpu.device_per_rank or cpu.one_process or cpu.initialises_on_host) and cpu.plans_memory
    assert not (cuda.traced or cuda.one_process or cuda.initialises_on_host) and cuda.plans_memory
    assert cuda.model_parallel and cuda.recomputes and cuda.fused_optimizer
    assert not (xla.on_host or xla.host_memory or xla.c_kernels or xla.device_per_rank)
    other = backend("meta")  # plain PyTorch: none of frugality's own, memory not planned
    assert type(other) is OtherBackend and not (other.plans_memory or other.on_host or other.c_kernels)
    assert not (other.traced or other.device_per_rank) and other.generator_device() == torch.device("meta")


def test_the_host_memory_and_peak_are_read_through_the_cpu_backend():
    free, total = device_memory(torch.device("cpu"))
    assert 0 < free <= total and backend("cpu").memory()[1] == total
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
    holding = _resident()
    del block
    peak = peak_memory_bytes(torch.device("cpu"))
    # the process's high-water mark (VmHWM), whatever the allocator did with the block since
    assert peak is not None and peak > holding - 8 * 2**20 and abs(peak - _status("VmHWM")) < 8 * 2**20
    with backend("cpu").inference():
        assert torch.is_inference_mode_enabled()
    with backend("xla").inference():
        assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()


def _status(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith(f"{field}:"))


def _resident() -> int:
    return _status("VmRSS")


def _kind_comparisons(path: Path):
    """(line, kind) for each comparison of a `.type` attribute with a string (==, !=, in,
    not in; either side; a tuple, list or set of strings) in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(side, ast.Attribute) and side.attr == "type" for side in sides):
            continue
        for side in sides:
            for v in side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    yield node.lineno, v.value


def test_the_walk_finds_each_way_of_writing_a_kind_comparison(tmp_path):
    code = tmp_path / "c.py"
    code.write_text('a = d.type == "cuda"\nb = "xla" != d.type\nc = d.type in ["cpu", "mps"]\nd = x.kind == "cpu"\n')
    assert sorted(_kind_comparisons(code)) == [(1, "cuda"), (2, "xla"), (3, "cpu"), (3, "mps")]


def test_code_outside_the_backends_asks_them_rather_than_comparing_device_kinds():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(KIND_CODE):
            continue
        found += [(rel, line, kind) for line, kind in _kind_comparisons(path)]
    counted = {key: sum(1 for rel, _, kind in found if (rel, kind) == key) for key in ALLOWED}
    unexpected = [f for f in found if (f[0], f[2]) not in ALLOWED]
    assert not unexpected and counted == ALLOWED, "ask frugality.backends.backend(device) instead:\n" + "\n".join(
        map(str, unexpected or found)
    )
    assert sum(1 for p in SRC.rglob("*.py") for _ in _kind_comparisons(p)) > 5  # (the walk sees comparisons)

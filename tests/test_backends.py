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
# the others left, each for a reason: a tensor on the meta device (no data to read), the
# peers' own CUDA-only recipe (liger-kernel, torchtitan; as their authors run them)
ALLOWED = {("tasks/masked_lm.py", "meta"), ("bench/peers.py", "cuda")}


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
    other = backend("meta")
    assert type(other) is OtherBackend and not (other.plans_memory or other.on_host or other.model_parallel)
    assert other.peak_memory() is None


def test_the_host_memory_and_peak_are_read_through_the_cpu_backend():
    free, total = device_memory(torch.device("cpu"))
    assert 0 < free <= total and backend("cpu").memory()[1] == total
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    status = Path("/proc/self/status").read_text()
    resident = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    peak = peak_memory_bytes(torch.device("cpu"))
    assert peak is not None and peak >= resident > block.numel() * 4  # the peak resident set, not the current
    with backend("cpu").inference():
        assert torch.is_inference_mode_enabled()
    with backend("xla").inference():
        assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()


def _kind_comparisons(path: Path):
    """(line, kind) for each `<x>.type == "kind"` (or !=, in, not in) in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type":
            for right in node.comparators:
                values = right.elts if isinstance(right, ast.Tuple) else [right]
                for v in values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        yield node.lineno, v.value


def test_code_outside_the_backends_asks_them_rather_than_comparing_device_kinds():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(KIND_CODE):
            continue
        found += [(rel, line, kind) for line, kind in _kind_comparisons(path) if (rel, kind) not in ALLOWED]
    assert not found, "ask frugality.backends.backend(device) instead:\n" + "\n".join(map(str, found))
    assert sum(1 for p in SRC.rglob("*.py") for _ in _kind_comparisons(p)) > 5  # (the walk sees comparisons)

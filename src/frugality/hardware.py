"""What the machine at hand can do: the device, the instruction sets that decide which
precision and which kernels are fast on it, and measured product speeds.

The choice that matters most is whether bf16 matrix products are native. Where they are
(CPUs with AMX or AVX512-BF16, CUDA GPUs of compute capability 8.0 and later) bf16 runs
2-4x faster than fp32; where they are not, torch's bf16 products fall back to generic
code: a 2048^3 product ran at 0.3 GFLOP/s in bf16 against 173 in fp32 on a 2-core AVX2
AMD EPYC (torch 2.13). Peers decide the same way: PyTorch Lightning and HF accelerate pick
a precision from the device, llama.cpp and ONNX Runtime dispatch kernels by the instruction
sets found at run time.

The instruction sets are read from /proc/cpuinfo and narrowed by the limits a user can set
on torch's own libraries, so that `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`
makes an AMX machine behave (and be treated) as an AVX2-only one, frugality's C kernels
included. The measured product speed (`product_rate`) is cached per machine fingerprint.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from frugality import xla
from frugality.backends import backend
from frugality.paths import cache_dir

# CPU feature flags that change what frugality runs (Linux /proc/cpuinfo names).
X86_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
ARM_FEATURES = ("asimd", "sve", "bf16", "i8mm")  # asimd = NEON

# ONEDNN_MAX_CPU_ISA values (oneDNN's names), lowest first; each also allows those before it.
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)


@dataclass(frozen=True)
class Hardware:
    """One device's capabilities. `features` are the usable ones (CPU flags within any
    user-set limit); `native_bf16` says whether bf16 products run at hardware speed."""

    device_type: str  # "cpu", "cuda"
    name: str  # CPU model or GPU name
    features: tuple[str, ...]  # CPUs: usable instruction sets, e.g. ("avx2", "fma")
    torch_isa: str  # CPUs: torch.backends.cpu.get_cpu_capability(); CUDA: "sm_90" etc.
    cores: int  # CPUs: logical CPUs this process may use; CUDA: multiprocessors
    threads: int  # torch's intra-op threads (CPUs)
    native_bf16: bool
    why: str  # one phrase: what native_bf16 rests on

    def has(self, feature: str) -> bool:
        return feature in self.features

    def describe(self) -> str:
        """One line for a run header or `frugality recipes`."""
        if self.device_type == "xla":
            where = self.name
        elif self.device_type == "cuda":
            where = f"{self.name} ({self.torch_isa}, {self.cores} SMs)"
        else:
            isa = ", ".join(self.features) or "no vector extensions found"
            threads = f"{self.threads} thread{'s' * (self.threads != 1)} in this process"  # (a rank's, under --nproc)
            where = f"{self.name} ({self.cores} cores, {threads}; {isa})"
        return f"{where}; bf16 products {'native' if self.native_bf16 else 'not native'}: {self.why}"


def probe(device: torch.device | str = "cpu") -> Hardware:
    """The capabilities of `device` (a CPU, a CUDA GPU, or an XLA device)."""
    device = torch.device(device)
    if device.type == "xla":
        return _probe_xla(xla.client())
    if device.type == "cuda":
        return _probe_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return _probe_cpu(
        torch.get_num_threads(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""), os.environ.get("ATEN_CPU_CAPABILITY", "")
    )


@cache
def _probe_xla(client: str) -> Hardware:
    """An XLA device by its PJRT client. TPUs and Trainium compute in bf16 natively; XLA's CPU
    client runs bf16 products slower than fp32 (119 against 168 GFLOP/s at 1024 squared on
    a 2-core AMD EPYC with AVX512-BF16, torch-xla 2.9), so there `auto` trains in fp32."""
    native = client in ("TPU", "NEURON")
    if client == "CUDA":
        native = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)
    why = {
        "TPU": "TPU matrix units compute in bf16",
        "NEURON": "Trainium's tensor engine computes in bf16",
        "CPU": "XLA's CPU client computes bf16 products slower than fp32",
    }.get(client, f"PJRT client {client}")
    cores = len(os.sched_getaffinity(0)) if client == "CPU" else 1
    return Hardware(
        "xla", f"XLA {client} (torch-xla {xla.version()})", (), client, cores, torch.get_num_threads(), native, why
    )


@cache
def _probe_cuda(index: int) -> Hardware:
    major, minor = torch.cuda.get_device_capability(index)
    props = torch.cuda.get_device_properties(index)
    native = (major, minor) >= (8, 0)
    why = f"compute capability {major}.{minor}" + ("" if native else " (bf16 tensor cores need 8.0)")
    return Hardware("cuda", props.name, (), f"sm_{major}{minor}", props.multi_processor_count, 0, native, why)


@cache
def _probe_cpu(threads: int, onednn_limit: str, aten_limit: str) -> Hardware:
    flags = cpu_flags()
    features = [f for f in (*X86_FEATURES, *ARM_FEATURES) if f in flags]
    limit = onednn_limit.strip().upper()
    if limit and limit not in ("ALL", "DEFAULT") and limit in _ONEDNN_ISAS:
        rank = _ONEDNN_ISAS.index(limit)
        allowed_avx512 = rank >= _ONEDNN_ISAS.index("AVX512_CORE")
        allowed_bf16 = rank >= _ONEDNN_ISAS.index("AVX512_CORE_BF16")
        allowed_amx = "AMX" in limit
        features = [
            f
            for f in features
            if not (f.startswith("amx") and not allowed_amx)
            and not (f == "avx512_bf16" and not allowed_bf16)
            and not (f.startswith("avx512") and not allowed_avx512)
        ]
    if aten_limit.strip().lower() in ("avx2", "default"):  # ATen's own vector code stays below AVX-512
        features = [f for f in features if not f.startswith("avx512")]  # oneDNN's AMX is not ATen's
    torch_isa = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "unknown"
    if "amx_bf16" in features:
        native, why = True, "AMX"
    elif "avx512_bf16" in features:
        native, why = True, "AVX512-BF16"
    elif "bf16" in features and platform.machine().lower() in ("aarch64", "arm64"):
        native, why = True, "Arm BF16 extension"
    else:
        best = next((f for f in ("avx512f", "avx2", "sve", "asimd") if f in features), "")
        native, why = False, f"{best.upper() or 'this CPU'} has no bf16 dot-product instructions"
        if onednn_limit and ("avx512_bf16" in flags or "amx_bf16" in flags):
            why = f"limited to {limit} by ONEDNN_MAX_CPU_ISA"
        elif aten_limit and "avx512_bf16" in flags:
            why = f"limited to {aten_limit} by ATEN_CPU_CAPABILITY"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Hardware("cpu", cpu_name(), tuple(features), torch_isa, cores, threads, native, why)


def onednn_capped_below(isa: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (or its older name, DNNL_MAX_CPU_ISA) keeps oneDNN below
    `isa` (one of oneDNN's names)."""
    limit = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if not limit or limit in ("ALL", "DEFAULT") or limit not in _ONEDNN_ISAS:
        return False
    return _ONEDNN_ISAS.index(limit) < _ONEDNN_ISAS.index(isa)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (x86 `flags`, Arm `Features`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name."""
    device = torch.device(device)
    if device.type == "xla":
        return probe(device).name
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def fingerprint(device: torch.device) -> str:
    """What a measured speed depends on: the device, torch, the threads and the ISA limits."""
    hw = probe(device)
    return (
        f"{hw.name}|{device.type}|torch {torch.__version__}|threads {hw.threads}|{','.join(hw.features)}|{hw.torch_isa}"
    )


def product_rate(device: torch.device, dtype: torch.dtype) -> float:
    """The machine's square-product speed in `dtype` (FLOP/s): `measure_product_rate` once
    per machine fingerprint, cached in `<cache>/products.json` (written through a temporary
    file of this process's own, then renamed: ranks that measure at once never clash). MFU's
    peak and `frugality recipes`' speeds come from here (the doctor measures afresh with
    `measure_product_rate`)."""
    cache_file = cache_dir() / "products.json"
    key = f"{fingerprint(device)}|{dtype}"  # the ISA limits in force change the rate
    if backend(device).compute_capability() is not None and dtype == torch.float32 and _tf32_on():
        key += "|tf32"  # train.tf32: fp32 products at TF32's rate, MFU against TF32's peak
    cached = _read_json(cache_file)
    if key not in cached:
        cached = {**_read_json(cache_file), key: measure_product_rate(device, dtype)}  # others' since, kept
        _write_json(cache_file, cached)
    return float(cached[key])


def _tf32_on() -> bool:
    # (not `allow_tf32`: reading it raises once the newer `fp32_precision` has been set)
    return torch.get_float32_matmul_precision() != "highest"


def measure_product_rate(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of square matmuls: the median of five timed calls after a warm-up call. Not
    the best call: one mistimed call on a shared machine once read 2.3x the sustained rate
    and would have halved every MFU computed against it."""
    probe = ProductProbe(device, dtype, size)
    return statistics.median(probe.sample() for _ in range(5))


class ProductProbe:
    """A square product in `dtype`, timed once per `sample()` (FLOP/s): the one probe of the
    product speed. Without a `size`: 8192 on GPUs, 2048 on CPUs, or smaller where the dtype
    is slow here (emulated bf16 ran at 0.3 GFLOP/s: 57 s a call at 2048), so that a call
    stays short. A benchmark samples it between its own steps for the peak of that moment."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int | None = None) -> None:
        self.device = device
        self.n = size or product_size(device, dtype)
        self.a = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.b = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.c = torch.mm(self.a, self.b)  # warms up the kernel and the allocator (XLA: compiles its graph)
        _sync(device)

    def sample(self) -> float:
        _sync(self.device)
        t0 = _clock()
        self.c = torch.mm(self.a, self.b)  # kept: XLA would not compute a product nobody holds
        _sync(self.device)
        return 2.0 * self.n**3 / max(_clock() - t0, 1e-12)


_clock = time.perf_counter  # looked up at each call: a test can time the probe with its own clock


def product_size(device: torch.device, dtype: torch.dtype, largest: int = 2048, seconds: float = 0.25) -> int:
    """The probe's square size: 8192 on GPUs; on CPUs the largest power of two up to
    `largest` whose product takes about `seconds` at the rate a 256-square product shows."""
    if device.type == "cuda":
        return 8192
    if device.type == "xla":
        return 1024 if xla.client() == "CPU" else 8192
    n = 256
    a = torch.randn(n, n).to(dtype)
    torch.mm(a, a)
    t0 = time.perf_counter()
    torch.mm(a, a)
    rate = 2.0 * n**3 / max(time.perf_counter() - t0, 1e-9)
    while n < largest and 2.0 * (2 * n) ** 3 / rate <= seconds:
        n *= 2
    return n


def _sync(device: torch.device) -> None:
    backend(device).synchronize()  # (XLA: the product's graph cut, compiled, run, and waited for)


def report(device: torch.device) -> dict:
    """The capabilities and the fp32 and bf16 product speeds, as a dict for JSON."""
    hw = probe(device)
    return asdict(hw) | {
        "fp32_gflops": round(product_rate(device, torch.float32) / 1e9, 1),
        "bf16_gflops": round(product_rate(device, torch.bfloat16) / 1e9, 1),
    }


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    from frugality.paths import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(data, indent=1))


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory: a GPU's, or for CPUs the host's RAM
    (`frugality.backends`)."""
    return backend(device).memory()

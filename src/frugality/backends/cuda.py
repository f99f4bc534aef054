"""CUDA GPUs: NCCL among the ranks, a GPU each, the caching allocator's peak, an
asynchronous queue to wait for before a clock stops."""

from __future__ import annotations

from typing import ClassVar

import torch

from frugality.backends.base import Backend


class CudaBackend(Backend):
    kind: ClassVar[str] = "cuda"
    process_group: ClassVar[str] = "nccl"
    device_per_rank: ClassVar[bool] = True
    replays_graphs: ClassVar[bool] = True
    asynchronous: ClassVar[bool] = True

    @classmethod
    def available(cls) -> bool:
        return torch.cuda.is_available()

    def local_count(self) -> int | None:
        return torch.cuda.device_count()

    def compute_capability(self) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability(self.device)

    def local_device(self, local_rank: int, distributed: bool) -> torch.device:
        return torch.device("cuda", local_rank) if distributed else self.device

    def join(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def peak_memory(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

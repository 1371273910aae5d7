"""The compute device: parsing and checking ``--device``, and how much memory it has free.

Every CUDA call in the runtime names the device it means (``cuda:N``, never "the current one"):
on a machine with several GPUs, the current device is not necessarily the one the model lives on.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SpecFitError

__all__ = ["resolve_device", "free_device_bytes", "available_host_bytes", "upload", "to_host"]


def resolve_device(spec: str | torch.device | None, option: str = "--device") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a :class:`torch.device` (CUDA with an explicit index);
    one clear error for anything else, for CUDA where there is none, or an index out of range."""
    if spec is None:
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise SpecFitError(f"{option} {spec!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise SpecFitError(f"{option} {spec!r}: expected cpu, cuda or cuda:N (the runtime supports no other device)")
    if not torch.cuda.is_available():
        raise SpecFitError(f"{option} {spec!r}: no CUDA device is available here; use {option} cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise SpecFitError(f"{option} {spec!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def available_host_bytes() -> int | None:
    """Host memory new allocations can get without swapping or the kernel killing someone
    (``MemAvailable`` of ``/proc/meminfo``); None where the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes that new device allocations can still get: the driver's free memory plus what
    PyTorch's caching allocator holds but does not use (``mem_get_info`` alone misses those).
    On the CPU the "device" buffers are host memory: what the host has available."""
    device = torch.device(device)
    if device.type != "cuda":
        return available_host_bytes()
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting: on CUDA it is staged in pinned memory from
    PyTorch's host allocator (which keeps the block until the copy has run, so the staging
    memory is never overwritten early) and copied asynchronously; on the CPU it is shared."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A device tensor as a numpy array: a synchronising copy, kept to one per MoE layer (the
    routing) on the hot path."""
    return tensor.cpu().numpy()

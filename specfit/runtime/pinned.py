"""Page-locked host memory of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` allocates through PyTorch's caching host allocator, which
rounds every block up to a power of two (see ``torch.cuda.host_memory_stats``): a 768 MiB layer
of experts pins 1 GiB, a 1.75 GiB one 2 GiB, and the blocks stay cached after use. Here memory is
allocated pageable by the plain CPU allocator, aligned to a page, and registered with
``cudaHostRegister`` (through ``torch.cuda.cudart()``): what is locked is the tensor's bytes rounded
up to one page. Registered memory is what the copy engine needs for asynchronous DMA, the same as
``cudaHostAlloc``'s.

The registrar is an object with ``register(ptr, nbytes)`` and ``unregister(ptr)``; tests pass a
recording fake, so the sizes and alignment of what would be pinned are checked without a GPU.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from ..errors import SpecFitError

__all__ = ["PAGE_BYTES", "page_round", "CudaHostRegistrar", "PinnedHostMemory"]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CUDA_HOST_REGISTER_PORTABLE = 1   # pinned for every CUDA context, so any cuda:N copies asynchronously


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: what registering them locks."""
    return -(-int(nbytes) // PAGE_BYTES) * PAGE_BYTES


class CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` of the CUDA runtime PyTorch links."""

    def __init__(self):
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int) -> None:
        status = self._cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        if status != self._cudart.cudaError.success:
            raise SpecFitError(f"pinning host memory: cudaHostRegister of {nbytes / 2**30:.2f} GiB failed "
                               f"({self._cudart.cudaGetErrorString(status)}); the host may not have that much "
                               f"lockable memory (ulimit -l, or fewer experts in host memory)")

    def unregister(self, ptr: int) -> None:
        self._cudart.cudaHostUnregister(ptr)


def _unregister_all(registrar, regions: list, buffers: list) -> None:
    # runs before the buffers are freed: they are held here until the registrations are gone
    for ptr, _ in regions:
        registrar.unregister(ptr)
    regions.clear()
    buffers.clear()


class PinnedHostMemory:
    """Host tensors allocated page-aligned and, with a ``registrar``, page-locked one by one.

    Without a registrar the tensors are ordinary pageable memory (the CPU runtime), allocated the
    same way. Registrations are undone when this object is collected or :meth:`release` is
    called; tensors handed out stay valid (pageable) after that.
    """

    def __init__(self, registrar=None):
        self.registrar = registrar
        self._regions: list[tuple[int, int]] = []       # (ptr, nbytes) registered
        self._buffers: list[torch.Tensor] = []
        self._release = weakref.finalize(self, _unregister_all, registrar, self._regions, self._buffers) \
            if registrar is not None else None

    @staticmethod
    def tensor_bytes(shape, dtype: torch.dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor whose bytes start on a page boundary (so no two
        registrations share a page) and, with a registrar, are locked."""
        nbytes = self.tensor_bytes(shape, dtype)
        span = page_round(nbytes)
        raw = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE_BYTES
        region = raw[start:start + span]
        if self.registrar is not None and span:
            self.registrar.register(region.data_ptr(), span)
            self._regions.append((region.data_ptr(), span))
        self._buffers.append(raw)
        return region[:nbytes].view(dtype).view(shape)

    @property
    def pinned_bytes(self) -> int:
        """Bytes locked now (page-rounded sizes of the registered tensors)."""
        return sum(n for _, n in self._regions)

    @property
    def regions(self) -> list[tuple[int, int]]:
        return list(self._regions)

    def release(self) -> None:
        """Unregister everything now (the tensors become pageable)."""
        if self._release is not None:
            self._release()

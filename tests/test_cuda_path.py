"""The CUDA paths' logic, checked on the CPU: what gets pinned, which stream and device every
call uses, how many events and synchronising calls a pass makes, what the probes allocate.

Nothing here needs a GPU: the CUDA runtime's entry points are replaced by recording fakes, and the
code under test is the same code that runs on CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

from specfit.calibrate.standin import SHAPE_CONFIGS, shape_config
from specfit.runtime.offload import HostExperts
from specfit.runtime.pinned import PAGE_BYTES


class RecordingRegistrar:
    """Stands in for cudaHostRegister / cudaHostUnregister: records the ranges."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr, nbytes):
        for other, size in self.registered.items():
            assert ptr + nbytes <= other or other + size <= ptr, "registrations overlap"
        self.registered[ptr] = nbytes

    def unregister(self, ptr):
        assert ptr in self.registered
        self.unregistered.append(ptr)


# ----------------------------------------------------------------- pinned host memory
def test_pinned_experts_lock_their_own_bytes_page_aligned():
    registrar = RecordingRegistrar()
    # odd sizes, so no matrix is a whole number of pages
    host = HostExperts(3, 5, hidden_size=37, intermediate_size=11, dtype=torch.bfloat16, registrar=registrar)
    assert host.pinned
    tensors = host.gate_up + host.down
    assert len(registrar.registered) == len(tensors) == 6
    for tensor in tensors:
        ptr = tensor.data_ptr()
        assert ptr % PAGE_BYTES == 0 and ptr in registrar.registered
        assert tensor.nbytes <= registrar.registered[ptr] < tensor.nbytes + PAGE_BYTES
        assert tensor.is_contiguous()
    assert host.pinned_bytes == sum(registrar.registered.values())
    assert 0 <= host.pinned_bytes - host.nbytes < PAGE_BYTES * len(tensors)
    assert host.pinned_bytes == HostExperts.planned_pinned_bytes(3, 5, 37, 11, torch.bfloat16)
    # the tensors are usable memory of the right layout
    host.gate_up[2].fill_(1.5)
    host.down[0].zero_()
    host.down[0][4].fill_(-2.0)
    assert bool((host.gate_up[2] == 1.5).all()) and bool((host.down[0][4] == -2.0).all())
    assert not bool((host.down[0][3] == -2.0).all())
    del host, tensors, tensor
    gc.collect()
    assert sorted(registrar.unregistered) == sorted(registrar.registered)


def test_unpinned_experts_register_nothing():
    host = HostExperts(2, 4, 8, 4, torch.float32)
    assert not host.pinned and host.pinned_bytes == 0
    assert host.nbytes == 2 * 4 * 3 * 8 * 4 * 4


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"])
def test_planned_pinned_bytes_of_full_models_equal_their_expert_bytes(shape):
    config = shape_config(shape)
    L, E, H, I = config.n_layers, config.n_experts, config.hidden_size, config.expert_intermediate_size
    checkpoint_bytes = L * E * 3 * H * I * 2          # bf16 gate, up and down of every expert
    planned = HostExperts.planned_pinned_bytes(L, E, H, I, torch.bfloat16)
    assert 0 <= planned - checkpoint_bytes < PAGE_BYTES * 2 * L
    # what the caching host allocator's power-of-two blocks would have locked
    def pow2(n):
        return 1 << (n - 1).bit_length()
    rounded = L * (pow2(E * 2 * I * H * 2) + pow2(E * H * I * 2))
    if shape != "olmoe-1b-7b":
        assert rounded > 1.1 * checkpoint_bytes       # 72 vs 54 GiB, 96 vs 84 GiB
    assert SHAPE_CONFIGS[shape]["hidden_size"] == H

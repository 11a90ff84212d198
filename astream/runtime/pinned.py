"""Page-locked host memory of exactly the size asked for, returned to the OS when released.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of
two and keeps freed blocks cached for the life of the process: a 1.1 GB layer of host
KV pins 2 GiB, and closing the engine gives none of it back. The host KV pool is sized
from the memory the host has, so it registers ordinary memory with the driver instead:
exactly its bytes are locked, and unlocked when the pool is released.
"""

from __future__ import annotations

import weakref

import torch


class PinnedHostTensor:
    """Owns one host tensor; on CUDA its pages stay locked until `release()` or collection.

    Views of `tensor` stay valid after release (the memory is still allocated); copies
    from them are then merely no longer asynchronous.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.tensor = torch.empty(shape, dtype=dtype)
        self._unpin = None
        if pin and self.tensor.numel():
            _register(self.tensor)
            # The finalizer keeps the tensor alive until its pages are unlocked.
            self._unpin = weakref.finalize(self, _unregister, self.tensor)

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()


def _register(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the KV pool "
                           f"(CUDA error {int(err)}); lower offload_host_gib or num_kv_blocks")


def _unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

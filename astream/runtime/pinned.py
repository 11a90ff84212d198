"""Page-locked host memory of exactly the size asked for, returned to the OS when released.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of
two and keeps freed blocks cached for the life of the process: a 1.1 GB layer of host
KV pins 2 GiB, and closing the engine gives none of it back. The host KV pool is sized
from the memory the host has, so it registers ordinary memory with the driver instead:
exactly its bytes are locked, and unlocked when the pool is released.

One allocation, registered in pieces along its first dimension (the KV pool's layers)
where each piece is whole pages: a single registration of tens of GB (a million tokens of
a 36-layer model's fp8 KV is 72 GiB) can fail where 2 GiB pieces do not, and no copy or
kernel reads across layers. The pieces then start on a page boundary, so no two share a
page (the allocation takes one page more, never locked).
"""

from __future__ import annotations

import mmap
import time
import weakref

import torch


class PinnedHostTensor:
    """Owns one host tensor; on CUDA its pages stay locked until `release()` or collection.

    Views of `tensor` stay valid after release (the memory is still allocated); copies
    from them are then merely no longer asynchronous. `seconds`: how long allocating and
    locking took (the driver touches every page).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        start = time.perf_counter()
        self.tensor = _allocate(shape, dtype, pin)
        self._unpin = None
        self.pieces = 0
        if pin and self.tensor.numel():
            pieces = list(self.tensor.unbind(0)) if _splits(self.tensor) else [self.tensor]
            _register_all(pieces)
            self.pieces = len(pieces)
            # The finalizer keeps the tensor alive until its pages are unlocked.
            self._unpin = weakref.finalize(self, _unregister_all, self.tensor, pieces)
        self.seconds = time.perf_counter() - start

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()


def _splits(tensor: torch.Tensor) -> bool:
    """Whether the tensor registers one piece per index of its first dimension."""
    if tensor.dim() < 2 or tensor.shape[0] < 2:
        return False
    piece = tensor[0].numel() * tensor.element_size()
    return piece % mmap.PAGESIZE == 0 and tensor.data_ptr() % mmap.PAGESIZE == 0


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """torch.empty(shape), page-aligned where it will be registered in whole-page pieces."""
    element = torch.empty((), dtype=dtype).element_size()
    count = 1
    for size in shape:
        count *= size
    piece = count // shape[0] * element if len(shape) > 1 and shape[0] else 0
    if not pin or len(shape) < 2 or shape[0] < 2 or piece % mmap.PAGESIZE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(count * element + mmap.PAGESIZE, dtype=torch.uint8)
    skip = -raw.data_ptr() % mmap.PAGESIZE
    return raw[skip:skip + count * element].view(dtype).view(shape)


def _register_all(pieces: list[torch.Tensor]) -> None:
    for done, piece in enumerate(pieces):
        nbytes = piece.numel() * piece.element_size()
        err = torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), nbytes, 0)
        if int(err) != 0:
            _unregister_all(None, pieces[:done])
            total = sum(p.numel() * p.element_size() for p in pieces)
            raise RuntimeError(f"could not pin {total / 2**30:.2f} GiB of host memory for the KV "
                               f"pool (CUDA error {int(err)} at piece {done} of {len(pieces)}, "
                               f"{nbytes / 2**30:.2f} GiB each); lower offload_host_gib, "
                               "max_model_len or num_kv_blocks")


def _unregister_all(tensor: torch.Tensor | None, pieces: list[torch.Tensor]) -> None:
    for piece in pieces:
        torch.cuda.cudart().cudaHostUnregister(piece.data_ptr())

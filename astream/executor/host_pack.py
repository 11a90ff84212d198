"""Host arrays of one dtype sent to the device in a single copy, handed back as views.

A step's inputs are a handful of small integer arrays; each separate host-to-device copy
costs a pinned staging buffer and a launch, so they travel packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Each view starts where a fresh allocation would be aligned: kernels specialize on the
# alignment of their pointers, so a packed view compiles and runs like a tensor of its own.
ALIGN_BYTES = 16


@dataclass(slots=True)
class HostPack:
    dtype: np.dtype
    parts: list[np.ndarray] = field(default_factory=list)

    def add(self, values: np.ndarray | list) -> int:
        """Queue an array (any shape); returns its index in what `send` returns."""
        self.parts.append(np.asarray(values, dtype=self.dtype))
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued array as a tensor on `device`, all views of one buffer."""
        step = ALIGN_BYTES // np.dtype(self.dtype).itemsize
        offsets, total = [], 0
        for part in self.parts:
            offsets.append(total)
            total += -(-part.size // step) * step
        flat = np.empty(total, dtype=self.dtype)
        for offset, part in zip(offsets, self.parts):
            flat[offset:offset + part.size] = part.reshape(-1)
        tensor = torch.from_numpy(flat)
        if device.type != "cpu":
            tensor = tensor.pin_memory().to(device, non_blocking=True)
        return [tensor[offset:offset + part.size].view(part.shape)
                for offset, part in zip(offsets, self.parts)]

"""A step's small input tensors, made on the worker's device without stalling it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(
    values: Sequence[object], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA the copy goes through pinned memory and does
    not wait: a copy from pageable memory synchronizes the stream, i.e. waits for every kernel
    queued so far, once per tensor. torch's pinned-memory cache keeps the buffer until the
    copy is done."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

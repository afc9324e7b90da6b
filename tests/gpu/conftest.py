"""GPU tests: NCCL where every user trains. Skipped, with the reason, on a machine
without the GPUs a test needs (docs/gpu.md says how to run them)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def gpus_or_skip(count: int) -> int:
    """The number of visible GPUs, or a skip when fewer than `count` or no NCCL."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip(f"needs {count} GPU(s) with NCCL; this machine has "
                    f"{'no CUDA' if not torch.cuda.is_available() else 'no NCCL'}")
    found = torch.cuda.device_count()
    if found < count:
        pytest.skip(f"needs at least {count} GPUs for NCCL ranks of their own; {found} visible")
    return found

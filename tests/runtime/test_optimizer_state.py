"""AdamW state that Planaria makes itself (a received layer's, a restored checkpoint's)
is laid out as AdamW's own, whichever `train.optimizer_impl`: same keys, dtypes, shapes and
devices. On a GPU the for-loop and foreach AdamWs keep the step count on the CPU beside
CUDA parameters (the fused one beside them, always in float32); state that put it elsewhere would
break the next transfer (NCCL moves GPU tensors only) or slow every step."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from planaria.runtime.parallel.engine import LayerState
from planaria.runtime.parallel.optim import IMPLEMENTATIONS, empty_adam_state
from planaria.runtime.state.checkpoints import load_layer, snapshot_layer
from planaria.runtime.state.transfer import on_device

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]


def stepped_layer(device: str, seed: int, impl: str = "for-loop") -> LayerState:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, **IMPLEMENTATIONS[impl])
    for _ in range(2):
        module(torch.randn(4, 8, device=device)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return LayerState(0, module, optimizer, frozenset())


def layout(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {key: (t.dtype, tuple(t.shape), t.device) for key, t in state.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))  # train.optimizer_impl
def test_empty_adam_state_is_laid_out_as_adamw_lays_it_out(device, default_dtype, impl):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        layer = stepped_layer(device, seed=0, impl=impl)
        for param in layer.module.parameters():
            native = layer.optimizer.state[param]
            assert layout(empty_adam_state(layer.optimizer, param)) == layout(native)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("device", DEVICES)
def test_restored_layer_steps_on_exactly_as_the_saved_one(device):
    saved = stepped_layer(device, seed=0)
    restored = stepped_layer(device, seed=1)  # other values, same shapes
    restored.optimizer.state.clear()
    load_layer(restored, snapshot_layer(saved))
    for a, b in zip(saved.module.parameters(), restored.module.parameters()):
        assert layout(restored.optimizer.state[b]) == layout(saved.optimizer.state[a])
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(restored.optimizer.state[b][key], saved.optimizer.state[a][key])
    # The next step is the same on both: nothing AdamW reads was lost or moved.
    x = torch.randn(4, 8, device=device)
    for layer in (saved, restored):
        layer.module(x).square().sum().backward()
        layer.optimizer.step()
    for a, b in zip(saved.module.parameters(), restored.module.parameters()):
        assert torch.equal(a, b)


def test_tensors_off_the_communication_device_travel_as_staged_copies():
    params, step = torch.ones(3), torch.zeros(())
    staged = on_device([params, step], torch.device("cpu"))
    assert staged[0] is params and staged[1] is step  # already there: no copy
    moved = on_device([params, step], torch.device("meta"))
    assert all(t.device.type == "meta" for t in moved)
    assert params.device.type == "cpu" and step.device.type == "cpu"  # originals untouched

"""`KVCache`: the device and host tiers take their geometry and dtype from one `KVLayout`."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.block_pool import KVCacheError
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout

LAYOUT = KVLayout(
    num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3, dtype="bfloat16"
)


def test_tiers_share_the_layout_geometry() -> None:
    cache = KVCache(LAYOUT, num_host_blocks=3)
    assert cache.layout == LAYOUT and cache.block_size == 4
    assert tuple(cache.device_tensor.shape) == LAYOUT.shape == (2, 2, 6, 4, 2, 3)
    assert cache.device_tensor.dtype == torch.bfloat16
    assert cache.host_layout == KVLayout(2, 3, 4, 2, 3, "bfloat16")
    assert cache.host_tensor is not None
    assert tuple(cache.host_tensor.shape) == (2, 2, 3, 4, 2, 3)
    assert cache.host_tensor.dtype == torch.bfloat16
    assert not cache.device_tensor.any() and not cache.host_tensor.any()


def test_swap_out_and_in_move_whole_blocks() -> None:
    cache = KVCache(LAYOUT, num_host_blocks=3)
    cache.device_tensor.copy_(torch.randn(LAYOUT.shape).to(torch.bfloat16))
    before = cache.device_tensor.clone()
    cache.swap_out([(5, 0), (1, 2)])
    assert cache.host_tensor is not None
    assert torch.equal(cache.host_tensor[:, :, 0], before[:, :, 5])
    assert torch.equal(cache.host_tensor[:, :, 2], before[:, :, 1])
    cache.device_tensor.zero_()
    cache.swap_in([(2, 4), (0, 3)])
    assert torch.equal(cache.device_tensor[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.device_tensor[:, :, 3], before[:, :, 5])
    assert not cache.device_tensor[:, :, [0, 1, 2, 5]].any()


def test_a_swap_mixing_runs_and_single_blocks_moves_each_block_whole() -> None:
    """Blocks 0-2 -> host 1-3 coalesce into one run, 5 -> 0 is a run of its own; every
    layer and K/V moves, and the blocks the plan does not name keep their bits."""
    layout = KVLayout(
        num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
    )
    cache = KVCache(layout, num_host_blocks=5)
    assert cache.host_tensor is not None
    cache.device_tensor.copy_(torch.randn(layout.shape))
    cache.host_tensor.copy_(torch.randn(cache.host_tensor.shape))
    device, host = cache.device_tensor.clone(), cache.host_tensor.clone()
    cache.swap_out([(0, 1), (1, 2), (2, 3), (5, 0)])
    assert torch.equal(cache.host_tensor[:, :, 1:4], device[:, :, 0:3])
    assert torch.equal(cache.host_tensor[:, :, 0], device[:, :, 5])
    assert torch.equal(cache.host_tensor[:, :, 4], host[:, :, 4])
    assert torch.equal(cache.device_tensor, device)
    cache.swap_in([(3, 4), (0, 3), (1, 1)])
    assert torch.equal(cache.device_tensor[:, :, 4], device[:, :, 2])
    assert torch.equal(cache.device_tensor[:, :, 3], device[:, :, 5])
    assert torch.equal(cache.device_tensor[:, :, 1], device[:, :, 0])
    assert torch.equal(cache.device_tensor[:, :, [0, 2, 5]], device[:, :, [0, 2, 5]])


def test_no_host_tier_with_zero_host_blocks() -> None:
    cache = KVCache(LAYOUT, num_host_blocks=0)
    assert cache.host_layout is None and cache.host_tensor is None
    cache.swap_out([])  # an empty plan is fine
    cache.swap_in([])
    with pytest.raises(KVCacheError, match="no host tier"):
        cache.swap_out([(0, 0)])
    with pytest.raises(KVCacheError, match="no host tier"):
        cache.swap_in([(0, 0)])
    with pytest.raises(ValueError, match="num_host_blocks must be >= 0, got -1"):
        KVCache(LAYOUT, num_host_blocks=-1)


def test_device_tensor_must_match_the_layout() -> None:
    region = torch.zeros(LAYOUT.shape, dtype=torch.bfloat16)
    assert KVCache(LAYOUT, 0, device_tensor=region).device_tensor is region
    with pytest.raises(ValueError, match=r"KV tensor has shape .* torch.float32, expected"):
        KVCache(LAYOUT, 0, device_tensor=torch.zeros(LAYOUT.shape))
    with pytest.raises(ValueError, match=r"expected \(2, 2, 6, 4, 2, 3\) torch.bfloat16"):
        KVCache(LAYOUT, 0, device_tensor=torch.zeros((2, 2, 5, 4, 2, 3), dtype=torch.bfloat16))

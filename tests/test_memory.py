"""`HugePageArena`: pieces keep their bits, sit 64-byte aligned in mappings advised
MADV_HUGEPAGE, and a quantized model's streamed weights are placed there; the CPU KV
pool (`huge_page_zeros`) is on such pages too."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import load_model
from pdserve.kv.cache import KVCache, _block_rows
from pdserve.kv.layout import KVLayout
from pdserve.memory import HUGE_PAGE, HugePageArena, fault_in, huge_page_zeros
from pdserve.quant.linear import QuantLinear


def _smaps_field(address: int, field: str) -> list[str]:
    """A field of /proc/self/smaps (its words) for the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags")


def _all_vm_flags() -> list[tuple[int, int, list[str]]]:
    """Every mapping of /proc/self/smaps as (start, end, its VmFlags), read once (the
    file of a process that holds a model is long: one read per address took ~25 s)."""
    maps: list[tuple[int, int, list[str]]] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                maps.append((lo, hi, []))
            elif head == "VmFlags:":
                maps[-1][2].extend(line.split()[1:])
    return maps


def _flags_at(maps: list[tuple[int, int, list[str]]], address: int) -> list[str]:
    found = [flags for lo, hi, flags in maps if lo <= address < hi]
    assert len(found) == 1, f"{len(found)} mappings hold {address:#x}"
    return found[0]


def _resident(t: torch.Tensor) -> int:
    """Bytes of `t`'s pages in memory (mincore over exactly its range: the kernel may
    merge two adjacent mappings, so a mapping's Rss can include a neighbour's)."""
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + t.nbytes - lo) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, pages * page, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_pieces_keep_their_bits_aligned_in_advised_chunks() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    a = torch.randn(3, 5)
    b = torch.arange(7, dtype=torch.int16)
    c = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)  # larger than a chunk
    pa, pb, pc = arena.place(a), arena.place(b), arena.place(c)
    for orig, piece in ((a, pa), (b, pb), (c, pc)):
        assert piece.dtype == orig.dtype and piece.shape == orig.shape
        assert torch.equal(piece, orig) and piece.is_contiguous()
        assert piece.data_ptr() % 64 == 0
        assert "hg" in _vm_flags(piece.data_ptr())
    assert pb.data_ptr() == pa.data_ptr() + 64  # 60 bytes, then the next 64-byte line
    assert pc.data_ptr() % HUGE_PAGE == 0  # its own chunk, on a 2 MB boundary
    with pytest.raises(ValueError, match="chunk_bytes must be a multiple of 2097152, got 4096"):
        HugePageArena(chunk_bytes=4096)


def test_a_quantized_model_streams_its_weights_from_the_arena() -> None:
    """Every part the kernels read (exact: values, fp32 scales and minimums; int8: the
    records) is in an advised mapping; the tied embedding shares the LM head's copy."""
    for activations in ("fp32", "int8"):
        model = load_model(EngineConfig(quantization="gguf", activations=activations))
        maps = _all_vm_flags()
        for op in model.projection_ops():
            assert isinstance(op, QuantLinear)
            for call in op.kernel_calls:
                addresses = [call[1]] if call[0] == -1 else [a for a in call[1:4] if a]
                for address in addresses:
                    assert "hg" in _flags_at(maps, address), (activations, call)
        if activations == "fp32":
            assert model.embed_tokens.weight is model.lm_head_op.weights[0]


def test_the_cpu_kv_pool_is_zeroed_on_advised_huge_pages() -> None:
    """`huge_page_zeros` gives the layout's shape and dtype, zeroed and contiguous, on a 2 MB
    boundary in an advised mapping; a CPU KVCache's device tier is such a tensor, and a
    given transfer region is used as it is."""
    layout = KVLayout(
        num_layers=2, num_blocks=9, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32"
    )
    cache = KVCache(layout, num_host_blocks=2)
    pool = cache.device_tensor
    assert tuple(pool.shape) == layout.shape and pool.dtype == torch.float32
    assert pool.is_contiguous() and pool.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(pool.data_ptr()) and not pool.any()
    # The host tier (pinned under CUDA) is such memory too, apart from the pool.
    host = cache.host_tensor
    assert host is not None and cache.host_layout is not None
    assert tuple(host.shape) == cache.host_layout.shape and host.dtype == torch.float32
    assert "hg" in _vm_flags(host.data_ptr()) and not host.any()
    pool_end = pool.data_ptr() + pool.nbytes
    host_end = host.data_ptr() + host.nbytes
    assert host_end <= pool.data_ptr() or host.data_ptr() >= pool_end
    half = huge_page_zeros((5, 7), torch.float16)
    assert half.shape == (5, 7) and half.dtype == torch.float16 and not half.any()
    region = torch.zeros(layout.shape)
    assert KVCache(layout, 0, device_tensor=region).device_tensor is region


def test_the_kv_pool_is_faulted_in_behind_its_creation() -> None:
    """Nothing is written at creation (`huge_page_zeros` leaves the pages unmapped, and
    `fault_in` maps them without writing); a thread then faults the device tier in (all
    of it, still zeros), while the host tier stays unmapped until a swap writes it."""
    raw = huge_page_zeros((8 << 20,), torch.uint8)
    assert _resident(raw) == 0
    assert fault_in(raw, [(HUGE_PAGE, HUGE_PAGE + 4096)])
    assert 4096 <= _resident(raw) <= HUGE_PAGE and _resident(raw[:HUGE_PAGE]) == 0
    layout = KVLayout(
        num_layers=4, num_blocks=256, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32"
    )
    cache = KVCache(layout, num_host_blocks=256)
    pool, host = cache.device_tensor, cache.host_tensor
    assert host is not None and cache.faulting_in is not None
    cache.faulting_in.join(60)
    assert _resident(pool) == pool.nbytes and _resident(host) == 0 and not pool.any()
    pool[:, :, 5] = 1.0
    cache.swap_out([(5, 7)])
    assert torch.equal(host[:, :, 7], pool[:, :, 5]) and not host[:, :, :7].any()
    with pytest.raises(MemoryError, match="cannot map"):
        huge_page_zeros((1 << 50,), torch.uint8)  # past any machine's memory


def test_block_rows_follow_the_order_blocks_are_handed_out() -> None:
    """The fault-in order: ~2 MB of blocks in every (layer, K/V) slice, then the next."""
    layout = KVLayout(
        num_layers=1, num_blocks=700, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32"
    )
    block = 16 * 2 * 64 * 4  # 8 KiB: 256 blocks a 2 MB row
    per_slice = 700 * block
    rows = _block_rows(layout, 2 * per_slice)
    assert rows == [
        (0, 256 * block),
        (per_slice, per_slice + 256 * block),
        (256 * block, 512 * block),
        (per_slice + 256 * block, per_slice + 512 * block),
        (512 * block, per_slice),
        (per_slice + 512 * block, 2 * per_slice),
    ]

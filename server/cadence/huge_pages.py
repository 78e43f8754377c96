"""The shard's long-lived CPU tensors (the KV cache, the packed weights) on 2 MB pages.

A decode step streams every packed weight (363 MiB for the embedded model in bfloat16)
and reads the KV cache's blocks scattered over a pool of a gigabyte or more. On 4 KB
pages that is a TLB miss every 4 KB of weights and nearly every block of cache, and inside
a virtual machine each miss walks two page tables. On an Emerald Rapids guest whose host
keeps small pages (so only the guest's half of each walk gets shorter), 2 MB pages made a
decode step 0.998-1.031x as fast over eight runs, median 1.013x (two engines in one
process, steps alternated); with huge pages end to end the gain may be larger.

Linux's transparent huge pages in their usual `madvise` mode give 2 MB pages only to
memory that asks with madvise(MADV_HUGEPAGE). torch's allocator asks only under
`THP_MEM_ALLOC_ENABLE`, and then for every allocation of 2 MB or more: a step's
transient activations too, whose page faults may then wait on the kernel compacting
memory. So the shard asks for these tensors alone, allocated once at start.

`--no-huge-pages` (`CADENCE_HUGE_PAGES=0`) keeps them on torch's allocator. Where madvise
is refused (no transparent huge pages in the kernel), the memory is the same mapping on
ordinary pages, and nothing else changes.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from loguru import logger

from cadence.layers.packed import forget_packed_views

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes between tensors in one mapping: a cache line, what the kernels load
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
    """Whether this platform can ask for huge pages (Linux's madvise(MADV_HUGEPAGE))."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def thp_mode() -> str:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), or
    `unavailable` where it has none."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping with `nbytes` usable from a 2 MB boundary (zeroed by
    the kernel), advised onto huge pages where the kernel takes the advice; and the
    offset of that boundary."""
    size = -(-(nbytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    view = torch.frombuffer(region, dtype=torch.uint8, count=1)
    return region, (-view.data_ptr()) % HUGE_PAGE


def _tensor_at(
    region: mmap.mmap, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over the mapping's bytes from `offset` (its
    storage holds the mapping alive)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on 2 MB pages where `supported()`, touched now so
    the pages are taken at start, not in the first steps."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    # not one huge page's worth: a mapping of its own would only waste
    if not supported() or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region, offset = _mapping(nbytes)
    out = _tensor_at(region, offset, shape, dtype)
    out.zero_()  # already zero: this only takes the pages
    return out


@dataclass
class _Slot:
    owner: object  # the module or packed weight holding the tensor
    attr: str
    tensor: torch.Tensor


def _packed_tensors(model: torch.nn.Module) -> Iterator[_Slot]:
    """Every packed weight tensor the model's products read: cadence's own packings
    (`packed_weight` where it is a plain tensor, not oneDNN's opaque one) and the integer
    product's packed weights and scales."""
    seen: set[int] = set()

    def plain(t: object) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.device.type == "cpu"
            and t.layout == torch.strided
            and not t.is_mkldnn
            and t.is_contiguous()
            and t.numel() > 0
        )

    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if plain(packed) and id(packed) not in seen:
            seen.add(id(packed))
            yield _Slot(module, "packed_weight", packed)
        quantized = getattr(module, "quantized", None)
        for kernel in getattr(quantized, "kernels", None) or ():
            weight = getattr(kernel, "weight", None)
            for attr in ("packed", "scales"):
                t = getattr(weight, attr, None)
                if plain(t) and id(t) not in seen:
                    seen.add(id(t))
                    yield _Slot(weight, attr, t)


def place_packed_weights(model: torch.nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Moves the model's packed weights into one mapping on 2 MB pages where `supported()`
    and they come to `min_bytes` or more; returns the bytes moved (else 0). Call once
    every weight is packed: a step after it finds the moved tensors."""
    if not supported():
        return 0
    slots = list(_packed_tensors(model))
    starts, total = [], 0
    for slot in slots:
        starts.append(total)
        total += -(-slot.tensor.nbytes // ALIGN) * ALIGN
    if not slots or total < min_bytes:
        return 0
    region, offset = _mapping(total)
    for slot, start in zip(slots, starts, strict=True):
        t = slot.tensor
        moved = _tensor_at(region, offset + start, t.shape, t.dtype)
        moved.copy_(t)
        setattr(slot.owner, slot.attr, moved)
    forget_packed_views(model)
    logger.info(
        f"packed weights on 2 MB pages: {total / 2**20:.0f} MiB "
        f"(transparent huge pages: {thp_mode()})"
    )
    return total

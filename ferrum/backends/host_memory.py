"""Host memory in transparent huge pages, for what the CPU's kernels stream every step.

A decode step on the CPU reads every weight: with 4 KiB pages that is a TLB miss every 4 KiB, whose page
walks the GEMV's loads wait on. Where the
kernel offers transparent huge pages on request (/sys/kernel/mm/transparent_hugepage/enabled `madvise`, the
usual default, or `always`), memory mapped here is marked MADV_HUGEPAGE before it is first touched, so that
each 2 MiB of it is one page. torch's own allocator does this only with THP_MEM_ALLOC_ENABLE=1 in the
environment before its first allocation, and only for single allocations of 2 MiB or more; a model's
weights are hundreds of smaller tensors, so they are gathered into one mapping here (gather_into_huge_pages).
Where huge pages cannot be had (not Linux, THP `never`), memory is plain and everything works the same.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start: a cache line


def huge_pages_offered() -> bool:
    """Whether this kernel hands out transparent huge pages to memory that asks (madvise) for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uint8 tensor of `nbytes` on the host, zeroed, starting on a 2 MiB boundary of an anonymous mapping
    marked MADV_HUGEPAGE (its pages are backed as they are first touched). The tensor keeps the mapping."""
    size = nbytes + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def gather_into_huge_pages(tensors: Iterable[torch.Tensor], min_bytes: int = 4096) -> int:
    """Moves each contiguous host tensor of at least `min_bytes` (each storage once: a tensor met twice, as a
    tied embedding is, moves once) into one huge-page mapping, in place: `tensor.data` is swapped for its
    copy there, so that every module holding the tensor sees the copy. Returns the bytes moved. Call it
    before views of the tensors are taken elsewhere (a view keeps the old memory)."""
    chosen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() >= min_bytes \
                and t.storage_offset() == 0:
            chosen.setdefault(t.data_ptr(), t)
    if not chosen:
        return 0
    offsets, end = [], 0
    for t in chosen.values():
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    arena = huge_page_bytes(end)
    for t, offset in zip(chosen.values(), offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        t.data = copy
    _trim_heap()
    return end


def _trim_heap() -> None:
    """Hands the heap's freed pages (the tensors' old memory) back to the OS, where glibc can (malloc_trim):
    else they stay resident, unused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

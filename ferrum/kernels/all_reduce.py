"""One-shot all-reduce (sum) of a small tensor across the GPUs of one host, over buffers every rank
has mapped (peer-to-peer over NVLink), in one of two ways:

    pull   each rank copies its tensor into its own buffer, tells the others it has, waits until
           they have told it, then reads every peer's buffer over NVLink: two NVLink trips one
           after the other (the flag out, then the peers' data in)
    push   each rank writes its tensor into every rank's buffer (the peers' over NVLink), tells the
           others, waits until they have told it, then reads its own buffer only: the data and the
           flag travel together, one trip

Either way every rank sums the same values in rank order in float32, so every rank gets the same
bits, into its tensor in place.

The ranks' buffers and flags are symmetric memory (ferrum.engine.parallel.peer_all_reduce sets them
up); the kernel takes them as tables of addresses, one per rank. Each program owns one `BLOCK`-element
region of the tensor and synchronises with the same program of the other ranks only:

    epochs[pid]   this rank's count of the calls program `pid` took part in (local memory)
    flags         on every rank, WORLD slots per program: slot [pid, r] holds the last count rank r
                  announced for program pid (written by rank r over the peer mapping)
    buffers       on every rank, two halves of WORLD slots, [half][sender][element]: a call fills
                  half (count & 1) (pull: each rank its own slot of its own buffer; push: each rank
                  its slot of every buffer), so the next call through the same program fills the
                  other half while a slower rank may still read this one; a rank is at most one call
                  ahead of the others (it cannot pass the next call without their flags), so the
                  half it writes is never the one being read. Both ways share this layout, so calls
                  of either kind may follow each other

The flag is raised after a barrier of the program's threads, with release semantics at system
scope, and read with acquire semantics at system scope; so the data each thread wrote before the
barrier (to local or to peer memory) is visible to a peer that has seen the flag. The counts wrap
at 2**30; a peer's slot holds the count of this call, of the call before (not there yet) or of the
call after (it went on), so "arrived" is a comparison with two values. Nothing here depends on the
host: the counts live on the device, so the kernel can be captured in a CUDA graph and replayed
any number of times, in the same order on every rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait

BLOCK = 1024  # elements a program sums: 2 KB of bf16, 16 bytes a thread at 4 warps
COUNT_MASK = (1 << 30) - 1


@triton.jit
def _one_shot_sum_kernel(x_ptr: tl.tensor, n: tl.tensor, buffers: tl.tensor, flags: tl.tensor,
                         epochs: tl.tensor, HALF: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                         BLOCK: tl.constexpr, MASK: tl.constexpr, PDL: tl.constexpr,
                         PUSH: tl.constexpr) -> None:
    pdl_wait(PDL)  # the next kernel may launch now (and load its weights); x and the counts after the one before
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    count = tl.load(epochs + pid)
    half = (count & 1) * WORLD * HALF
    mine = tl.multiple_of(tl.load(buffers + RANK).to(tl.pointer_type(dtype)), 16)
    if PUSH:  # my slot of every rank's buffer
        for p in tl.static_range(WORLD):
            if p == RANK:
                tl.store(mine + half + RANK * HALF + offs, x, mask=inside)
            else:
                peer = tl.multiple_of(tl.load(buffers + p).to(tl.pointer_type(dtype)), 16)
                tl.store(peer + half + RANK * HALF + offs, x, mask=inside)
    else:  # my slot of my own buffer
        tl.store(mine + half + RANK * HALF + offs, x, mask=inside)
    arrived = (count + 1) & MASK
    ahead = (arrived + 1) & MASK
    tl.debug_barrier()  # every thread's store before the flag that announces them
    for p in tl.static_range(WORLD):
        if p != RANK:
            theirs = tl.load(flags + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(theirs + pid * WORLD + RANK, arrived, sem="release", scope="sys")
    own = tl.load(flags + RANK).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != RANK:
            seen = tl.atomic_add(own + pid * WORLD + p, 0, sem="acquire", scope="sys")
            while (seen != arrived) & (seen != ahead):
                seen = tl.atomic_add(own + pid * WORLD + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads a peer's data before its flag was seen
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += x.to(tl.float32)
        elif PUSH:  # the peer's data is in my buffer
            acc += tl.load(mine + half + p * HALF + offs, mask=inside, other=0.0, volatile=True).to(tl.float32)
        else:
            peer = tl.multiple_of(tl.load(buffers + p).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(peer + half + p * HALF + offs, mask=inside, other=0.0, volatile=True).to(tl.float32)
    tl.store(x_ptr + offs, acc.to(dtype), mask=inside)
    tl.store(epochs + pid, arrived)


def programs(numel: int) -> int:
    return triton.cdiv(numel, BLOCK)


def buffer_bytes(max_bytes: int, world: int) -> int:
    """Bytes of each rank's buffer for sums of up to max_bytes: two halves of WORLD slots."""
    return 2 * world * max_bytes


def one_shot_sum_(x: torch.Tensor, buffers: torch.Tensor, flags: torch.Tensor, epochs: torch.Tensor,
                  slot_bytes: int, rank: int, world: int, pdl: bool = False, push: bool = True) -> torch.Tensor:
    """Sums contiguous `x` over the ranks in place. `buffers` and `flags`: int64 tables of every
    rank's buffer (buffer_bytes(slot_bytes, world)) and flag (int32, WORLD per program) addresses;
    `epochs`: this rank's int32 count per program, zeros at first. push: write to the peers rather
    than have them read (see the module's note). pdl: launched with programmatic dependent launch
    (every program waits for the kernel before first, and lets the next one launch)."""
    n = x.numel()
    _one_shot_sum_kernel[(programs(n),)](x, n, buffers, flags, epochs, HALF=slot_bytes // x.element_size(),
                                         RANK=rank, WORLD=world, BLOCK=BLOCK, MASK=COUNT_MASK, PDL=pdl_mode(pdl),
                                         PUSH=push, num_warps=4, **pdl_launch(pdl))
    return x

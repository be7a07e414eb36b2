"""The one-shot all-reduce kernel's protocol, two ranks simulated in one process (on the GPU when
there is one, else in Triton's interpreter): each rank's call is launched alone, with the other
rank's data and flag already in place, so no call waits. Checks the sum, the flag each call leaves
in the other rank's slots, the count per program, and that the second call through a program
uses the other half of the buffers (the first half holds garbage by then)."""

from __future__ import annotations

import torch

from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import all_reduce as ar  # noqa: E402  (after the interpreter is chosen)

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # numpy (the interpreter) has no bf16
WORLD = 2
HALF = 8192  # bytes of each half of a rank's buffer


class Ranks:
    """Two ranks' symmetric memory (both halves, then the flags) and counts, in this process."""

    def __init__(self) -> None:
        slots = ar.programs(HALF // 2) * WORLD
        self.memory = [torch.zeros(2 * HALF + 4 * slots, dtype=torch.uint8, device=DEVICE) for _ in range(WORLD)]
        self.buffers = torch.tensor([m.data_ptr() for m in self.memory], dtype=torch.int64, device=DEVICE)
        self.flags = torch.tensor([m.data_ptr() + 2 * HALF for m in self.memory], dtype=torch.int64, device=DEVICE)
        self.epochs = [torch.zeros(ar.programs(HALF // 2), dtype=torch.int32, device=DEVICE) for _ in range(WORLD)]

    def half(self, rank: int, which: int, n: int) -> torch.Tensor:
        return self.memory[rank][which * HALF: which * HALF + 2 * n].view(DTYPE)

    def flag_slots(self, rank: int) -> torch.Tensor:
        return self.memory[rank][2 * HALF:].view(torch.int32)

    def call(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return ar.one_shot_sum_(x, self.buffers, self.flags, self.epochs[rank], HALF, rank, WORLD)


def test_each_rank_sums_in_the_same_order_and_alternates_halves() -> None:
    ranks = Ranks()
    gen = torch.Generator().manual_seed(0)
    for call, n in enumerate((3000, 1000, 4096)):  # 3, 1 and 4 programs: counts per program differ
        xs = [torch.randn(n, generator=gen).to(DTYPE).to(DEVICE) for _ in range(WORLD)]
        want = (xs[0].float() + xs[1].float()).to(DTYPE)
        programs = ar.programs(n)
        counts = [int(c) for c in ranks.epochs[0][:programs]]
        # rank 1 got there first: its rows in the half this call uses, its flags in rank 0's slots
        for p in range(programs):
            rows = slice(p * ar.BLOCK, (p + 1) * ar.BLOCK)
            ranks.half(1, counts[p] & 1, n)[rows] = xs[1][rows]
            ranks.half(1, 1 - (counts[p] & 1), n)[rows] = 1e4  # the other half: garbage, never read
            ranks.flag_slots(0)[p * WORLD + 1] = counts[p] + 1
        got0 = ranks.call(0, xs[0].clone())
        assert torch.equal(got0, want), call
        assert ranks.epochs[0][:programs].tolist() == [c + 1 for c in counts]
        assert [int(ranks.flag_slots(1)[p * WORLD]) for p in range(programs)] == [c + 1 for c in counts]
        # now rank 1's call: it finds rank 0's flag and rows, and gets the same bits
        got1 = ranks.call(1, xs[1].clone())
        assert torch.equal(got1, got0), call
        assert ranks.epochs[1][:programs].tolist() == [c + 1 for c in counts]


def test_a_peer_one_call_ahead_counts_as_arrived() -> None:
    """A rank that went on to its next call has overwritten its flag with the next count."""
    ranks = Ranks()
    n = 2048
    ranks.half(1, 0, n).fill_(2.0)
    ranks.flag_slots(0)[0 * WORLD + 1] = 2  # this call's count is 1; the peer already announced 2
    ranks.flag_slots(0)[1 * WORLD + 1] = 2
    got = ranks.call(0, torch.ones(n, dtype=DTYPE, device=DEVICE))
    assert torch.equal(got, torch.full_like(got, 3.0))

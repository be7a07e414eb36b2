"""The one-shot all-reduce kernel's protocol, both ways (push and pull), two ranks simulated in one
process (on the GPU when there is one, else in Triton's interpreter): each rank's call is launched
alone, with the other rank's data and flag already in place, so no call waits. Checks the sum, the
flag each call leaves in the other rank's slots, where each call leaves its data (pull: its own
buffer; push: every rank's), the count per program, and that the second call through a program
uses the other half of the buffers (the first half holds garbage by then)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import all_reduce as ar  # noqa: E402  (after the interpreter is chosen)

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # numpy (the interpreter) has no bf16
WORLD = 2
HALF = 8192  # bytes of each half of a rank's buffer


class Ranks:
    """Two ranks' symmetric memory (both halves of WORLD slots, then the flags) and counts, in this process."""

    def __init__(self, push: bool) -> None:
        self.push = push
        slots = ar.programs(HALF // 2) * WORLD
        self.data = ar.buffer_bytes(HALF, WORLD)
        self.memory = [torch.zeros(self.data + 4 * slots, dtype=torch.uint8, device=DEVICE) for _ in range(WORLD)]
        self.buffers = torch.tensor([m.data_ptr() for m in self.memory], dtype=torch.int64, device=DEVICE)
        self.flags = torch.tensor([m.data_ptr() + self.data for m in self.memory], dtype=torch.int64, device=DEVICE)
        self.epochs = [torch.zeros(ar.programs(HALF // 2), dtype=torch.int32, device=DEVICE) for _ in range(WORLD)]

    def slot(self, rank: int, which: int, sender: int, n: int) -> torch.Tensor:
        """Rank `rank`'s buffer: half `which`, the slot of `sender`'s data."""
        at = (which * WORLD + sender) * HALF
        return self.memory[rank][at: at + 2 * n].view(DTYPE)

    def landing(self, reader: int, sender: int) -> int:
        """Whose buffer holds `sender`'s data when `reader` reads it: its own (push) or the sender's (pull)."""
        return reader if self.push else sender

    def flag_slots(self, rank: int) -> torch.Tensor:
        return self.memory[rank][self.data:].view(torch.int32)

    def call(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return ar.one_shot_sum_(x, self.buffers, self.flags, self.epochs[rank], HALF, rank, WORLD, push=self.push)


@pytest.mark.parametrize("push", [True, False], ids=["push", "pull"])
def test_each_rank_sums_in_the_same_order_and_alternates_halves(push: bool) -> None:
    ranks = Ranks(push)
    gen = torch.Generator().manual_seed(0)
    for call, n in enumerate((3000, 1000, 4096)):  # 3, 1 and 4 programs: counts per program differ
        xs = [torch.randn(n, generator=gen).to(DTYPE).to(DEVICE) for _ in range(WORLD)]
        want = (xs[0].float() + xs[1].float()).to(DTYPE)
        programs = ar.programs(n)
        counts = [int(c) for c in ranks.epochs[0][:programs]]
        # rank 1 got there first: its rows in the half this call uses, its flags in rank 0's slots
        where = ranks.landing(0, 1)
        for p in range(programs):
            rows = slice(p * ar.BLOCK, (p + 1) * ar.BLOCK)
            ranks.slot(where, counts[p] & 1, 1, n)[rows] = xs[1][rows]
            ranks.slot(where, 1 - (counts[p] & 1), 1, n)[rows] = 1e4  # the other half: garbage, never read
            ranks.flag_slots(0)[p * WORLD + 1] = counts[p] + 1
        got0 = ranks.call(0, xs[0].clone())
        assert torch.equal(got0, want), call
        assert ranks.epochs[0][:programs].tolist() == [c + 1 for c in counts]
        assert [int(ranks.flag_slots(1)[p * WORLD]) for p in range(programs)] == [c + 1 for c in counts]
        for p in range(programs):  # rank 0's data where rank 1 will read it
            rows = slice(p * ar.BLOCK, min((p + 1) * ar.BLOCK, n))
            assert torch.equal(ranks.slot(ranks.landing(1, 0), counts[p] & 1, 0, n)[rows], xs[0][rows]), (call, p)
        # now rank 1's call: it finds rank 0's flag and rows, and gets the same bits
        got1 = ranks.call(1, xs[1].clone())
        assert torch.equal(got1, got0), call
        assert ranks.epochs[1][:programs].tolist() == [c + 1 for c in counts]


@pytest.mark.parametrize("push", [True, False], ids=["push", "pull"])
def test_a_peer_one_call_ahead_counts_as_arrived(push: bool) -> None:
    """A rank that went on to its next call has overwritten its flag with the next count."""
    ranks = Ranks(push)
    n = 2048
    ranks.slot(ranks.landing(0, 1), 0, 1, n).fill_(2.0)
    ranks.flag_slots(0)[0 * WORLD + 1] = 2  # this call's count is 1; the peer already announced 2
    ranks.flag_slots(0)[1 * WORLD + 1] = 2
    got = ranks.call(0, torch.ones(n, dtype=DTYPE, device=DEVICE))
    assert torch.equal(got, torch.full_like(got, 3.0))

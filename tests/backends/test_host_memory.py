"""Host memory in transparent huge pages (ferrum.backends.host_memory): values, ties and layout kept."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.backends.host_memory import HUGE_PAGE, gather_into_huge_pages, huge_page_bytes


def test_huge_page_bytes_are_zeroed_writable_and_start_on_a_huge_page() -> None:
    t = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert t.shape == (3 * HUGE_PAGE + 5,) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.sum()) == 0
    t[-5:] = 3
    assert int(t.sum()) == 15


class _Holder(nn.Module):
    packed: torch.Tensor
    scale: torch.Tensor
    small: torch.Tensor


def test_gather_moves_buffers_in_place_keeping_values_and_ties() -> None:
    torch.manual_seed(0)
    model = _Holder()
    model.register_buffer("packed", torch.randint(0, 255, (64, 96), dtype=torch.uint8))
    model.register_buffer("scale", torch.randn(64, 3, dtype=torch.float16))
    model.register_buffer("small", torch.ones(4))  # under min_bytes: stays
    other = nn.Module()
    other.register_buffer("shared", model.packed)  # one tensor held by two modules
    before = {name: t.clone() for name, t in model.named_buffers()}
    old_ptr = model.packed.data_ptr()

    moved = gather_into_huge_pages([*model.buffers(), *other.buffers()], min_bytes=256)

    assert moved >= 64 * 96 + 64 * 3 * 2
    for name, t in model.named_buffers():
        assert torch.equal(t, before[name]), name
    packed, scale = model.packed, model.scale
    assert packed.data_ptr() != old_ptr and packed.data_ptr() % 64 == 0
    assert other.get_buffer("shared") is packed
    # the two moved tensors share one mapping that starts on a huge page
    assert min(packed.data_ptr(), scale.data_ptr()) % HUGE_PAGE == 0
    assert model.small.data_ptr() not in (packed.data_ptr(), scale.data_ptr())
    assert gather_into_huge_pages([torch.ones(2)], min_bytes=256) == 0

"""StoredBytes.sliced: a block of rows is one range, columns one run per row; chunked reads at any
offsets give the slice's bytes, and only those bytes are read from the source."""

from __future__ import annotations

import pytest
import torch

from ferrum.weights.formats.readers import StoredBytes


def _stored(tensor: torch.Tensor, reads: list[tuple[int, int]], mapped: bool = False) -> StoredBytes:
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    def read(buffer: memoryview, offset: int) -> None:
        reads.append((offset, len(buffer)))
        buffer[:] = raw[offset : offset + len(buffer)]

    return StoredBytes(tensor.dtype, tuple(tensor.shape), read, memoryview(raw) if mapped else None)


@pytest.mark.parametrize("dim, start, end", [(0, 3, 7), (1, 2, 9), (2, 1, 3), (1, 0, 11)])
@pytest.mark.parametrize("chunk", [5, 64, 10_000])
def test_slices_read_in_chunks_equal_torch_slicing(dim: int, start: int, end: int, chunk: int) -> None:
    tensor = torch.arange(8 * 11 * 4, dtype=torch.float32).reshape(8, 11, 4)
    reads: list[tuple[int, int]] = []
    sliced = _stored(tensor, reads).sliced(dim, start, end)
    want = tensor.narrow(dim, start, end - start).contiguous()
    assert sliced.shape == tuple(want.shape) and sliced.nbytes == want.numel() * 4
    out = torch.empty(want.shape, dtype=torch.float32)
    buffer = out.view(-1).view(torch.uint8).numpy().data  # a memoryview of the bytes
    for offset in range(0, len(buffer), chunk):
        sliced.read(buffer[offset : offset + chunk], offset)
    assert torch.equal(out, want)
    assert sum(n for _, n in reads) == want.numel() * 4  # nothing outside the slice was read
    if dim == 0 and chunk >= len(buffer):
        assert len(reads) == 1  # a block of rows: one range


def test_a_slice_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="outside shape"):
        _stored(torch.zeros(4, 4), []).sliced(0, 2, 6)


@pytest.mark.parametrize("dim, start, end", [(0, 3, 7), (1, 2, 9), (2, 1, 3), (1, 0, 11), (1, 10, 11)])
@pytest.mark.parametrize("chunk", [5, 48, 100, 10_000])
def test_a_mapped_tensor_copies_whole_runs_as_one_strided_block(dim: int, start: int, end: int, chunk: int) -> None:
    """With the bytes mapped, whole runs are copied from the mapping; only a chunk's partial runs
    at its ends go through read() (none when the chunks fall on run boundaries)."""
    tensor = torch.arange(8 * 11 * 4, dtype=torch.float32).reshape(8, 11, 4)
    reads: list[tuple[int, int]] = []
    sliced = _stored(tensor, reads, mapped=True).sliced(dim, start, end)
    want = tensor.narrow(dim, start, end - start).contiguous()
    out = torch.empty(want.shape, dtype=torch.float32)
    buffer = out.view(-1).view(torch.uint8).numpy().data  # a memoryview of the bytes
    for offset in range(0, len(buffer), chunk):
        sliced.read(buffer[offset : offset + chunk], offset)
    assert torch.equal(out, want)
    if dim == 0 or end - start == tensor.shape[dim]:
        return  # one run: read as one range, mapped or not
    chunks = -(-len(buffer) // chunk)
    if chunks == 1:
        assert reads == [], reads  # one chunk of whole runs: no call per run
    assert len(reads) <= 3 * chunks, reads  # at most a partial run at each end, or one lone run, a chunk

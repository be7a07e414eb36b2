"""`TensorParallelError`: a rank could not start, or died."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """A rank could not start, or died."""

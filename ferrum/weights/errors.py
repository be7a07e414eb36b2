"""Errors of the weights package. Every error names where it happened: a file path, a URL, an
`s3://bucket/key`, a `hf://repo/file`, or `<memory>`; `str(err)` is `"<where>: <message>"`.

    WeightError                  base; `where` and `message` attributes
    ├── CorruptWeightsError      the bytes are not a valid file of their format (bad header, sizes, ...)
    ├── IntegrityError           checksum / size of a download does not match what was expected
    ├── SourceNotFoundError      the file / object / URL does not exist (404, NoSuchKey): not retried
    ├── SourceUnavailableError   a transient failure (5xx, throttling, reset, time-out): retried
    ├── UnsupportedError         a format, dtype, URL scheme or transformation Ferrum does not handle
    ├── TensorNotFoundError      the source exists but has no tensor of that name
    ├── TransformError           a transformation cannot be applied to the tensor it was given
    └── SpecMismatchError        after the transformations, shape or dtype differ from the TensorSpec
"""

from __future__ import annotations

__all__ = [
    "CorruptWeightsError",
    "IntegrityError",
    "SourceNotFoundError",
    "SourceUnavailableError",
    "SpecMismatchError",
    "TensorNotFoundError",
    "TransformError",
    "UnsupportedError",
    "WeightError",
]


class WeightError(Exception):
    """Base of all weights errors. `where`: the file, URL or key concerned; `message`: what is wrong."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(where, message)
        self.where = where
        self.message = message

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class CorruptWeightsError(WeightError):
    """The bytes are not a valid file of the format they claim (or were detected) to be."""


class IntegrityError(WeightError):
    """A download's size or checksum differs from the expected one."""


class SourceNotFoundError(WeightError):
    """The source does not exist (missing file, HTTP 404, S3 NoSuchKey). Never retried."""


class SourceUnavailableError(WeightError):
    """A transient failure (HTTP 5xx, 429/503 throttling, connection reset, time-out).
    `retry_after`: seconds the server asked to wait (Retry-After), when it said so."""

    def __init__(self, where: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(where, message)
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_unavailable, (self.where, self.message, self.retry_after))


def _rebuild_unavailable(where: str, message: str, retry_after: float | None) -> SourceUnavailableError:
    return SourceUnavailableError(where, message, retry_after=retry_after)


class UnsupportedError(WeightError):
    """Something Ferrum deliberately does not handle (ONNX, full pickles, quantization, ftp:// ...)."""


class TensorNotFoundError(WeightError):
    """The source has no tensor of the requested name."""


class TransformError(WeightError):
    """A transformation does not fit the tensor (bad dims, incompatible reshape, ...)."""


class SpecMismatchError(WeightError):
    """The loaded (and transformed) tensor's shape or dtype is not the one the TensorSpec asks for."""

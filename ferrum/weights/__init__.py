"""Ferrum's weights: where they come from, in which format, and the async WeightLoader.

    from ferrum.weights import WeightLoader, TensorSpec, File, Url, HuggingFace, S3, Memory

    loader = WeightLoader(WeightLoaderConfig())
    tensors = await loader.load_tensors([TensorSpec("w", (4, 4), "float16", source=File("m.safetensors"))])

See docs/design/weights.md for the layout of this package. `WeightLoader` and `index_shards` are
imported on first use, so `import ferrum.weights.errors` (from the download side) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrum.weights.errors import (
    CorruptWeightsError,
    IntegrityError,
    SourceNotFoundError,
    SourceUnavailableError,
    SpecMismatchError,
    TensorNotFoundError,
    TransformError,
    UnsupportedError,
    WeightError,
)
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import (
    S3,
    File,
    HuggingFace,
    Memory,
    RawLayout,
    Url,
    WeightFormat,
    WeightSource,
)
from ferrum.weights.spec.tensors import TensorSpec, WeightLoaderCapabilities, WeightMetadata
from ferrum.weights.spec.transforms import (
    Cast,
    Dequantize,
    Quantize,
    Reshape,
    Scale,
    Slice,
    TensorTransformation,
    Transpose,
)

if TYPE_CHECKING:
    from ferrum.weights.formats.readers import index_shards
    from ferrum.weights.loader import WeightLoader

__all__ = [
    "S3",
    "Cast",
    "CorruptWeightsError",
    "Dequantize",
    "File",
    "HuggingFace",
    "IntegrityError",
    "Memory",
    "Quantize",
    "RawLayout",
    "Reshape",
    "Scale",
    "Slice",
    "SourceNotFoundError",
    "SourceUnavailableError",
    "SpecMismatchError",
    "TensorNotFoundError",
    "TensorSpec",
    "TensorTransformation",
    "TransformError",
    "Transpose",
    "UnsupportedError",
    "Url",
    "WeightError",
    "WeightFormat",
    "WeightLoader",
    "WeightLoaderCapabilities",
    "WeightLoaderConfig",
    "WeightMetadata",
    "WeightSource",
    "index_shards",
]


def __getattr__(name: str) -> Any:
    if name == "WeightLoader":
        from ferrum.weights.loader import WeightLoader

        return WeightLoader
    if name == "index_shards":
        from ferrum.weights.formats.readers import index_shards

        return index_shards
    raise AttributeError(f"module 'ferrum.weights' has no attribute {name!r}")

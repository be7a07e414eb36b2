"""`WeightLoader`: tensors from any `WeightSource`, asynchronously.

    async with WeightLoader(config) as loader:
        tensors = await loader.load_tensors(specs)        # {spec.name: tensor}
        loaded = await loader.load(specs)                 # the same, a QuantizedTensor for a spec ending in Quantize

How a group of specs of one stored object is served (`load` groups them so that each object is
opened / fetched once, and works on all groups at once):

    File        memory-mapped in a thread (readers.open_local); a folder means its model.safetensors
                (or its index); an `*.index.json` sends each tensor to its shard
    Memory      read from the bytes (copied out once)
    HuggingFace hub_fetch (huggingface_hub's cache), then as a File
    Url / S3    SafeTensors: streamed: Downloader.open(obj) fetches the file into the cache
                while each tensor is made as soon as `wait_range` says its bytes are in (read from
                the cache's file as it grows); the download's verification (`result()`) is awaited
                before anything is returned. `fetching(source)` starts those downloads ahead, while
                the caller prepares (builds the model); the loads inside it join them.
                Other formats (GGUF included): Downloader.fetch, then as a File.

Transformations, the shape / dtype check and the move to `spec.device` run in threads, as does
every blocking read: the event loop never blocks on I/O. Plain specs (no transformations, on the
CPU) of a local file are made in the same thread call that opens it: views of the mmap, no copy.

With `into` (and the `Device` the destinations live on), each tensor goes straight into its
destination (a model's parameter, or rows of one) as soon as its bytes are there, through the
device's writer (ferrum.backends.transfer: pinned staging on CUDA, the destination's own memory
on the CPU): stored bytes that need no transformation are read directly into it (pread from a
local file, or from the download's file as its bytes arrive), others are made, transformed and
checked first. A spec ending in Quantize is always made first (read, sliced, cast, quantized: on
the CPU or on Quantize's compute device) and its QuantizedTensor's parts written into the parts of
its destination, a QuantizedTensor of storage views.
Destinations are written by several threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeAlias, TypeVar, cast

import torch

from ferrum.weights.errors import (
    CorruptWeightsError,
    IntegrityError,
    SourceNotFoundError,
    SpecMismatchError,
    TensorNotFoundError,
    TransformError,
    UnsupportedError,
    WeightError,
)
from ferrum.weights.formats.readers import (
    OpenedWeights,
    StoredBytes,
    format_from_name,
    is_index_name,
    metadata_from_header,
    open_bytes,
    open_local,
    parse_index,
    pread_into,
    stored_dtype,
    tensor_from_bytes,
)
from ferrum.weights.formats.safetensors_header import SafetensorsHeader, header_length, parse_header
from ferrum.weights.locations.model_files import local_weights
from ferrum.weights.quantization.tensor import QuantizedTensor
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
    object_of,
    sibling,
)
from ferrum.weights.spec.tensors import TensorSpec, WeightLoaderCapabilities, WeightMetadata, specs_by_name
from ferrum.weights.spec.transforms import Slice, apply_transformations, check_result

if TYPE_CHECKING:
    from ferrum.backends.device import Device
    from ferrum.backends.transfer import DeviceWriter
    from ferrum.weights.download.downloader import Download, Downloader
    from ferrum.weights.download.remote import RemoteObject

__all__ = ["WeightLoader"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Loaded: TypeAlias = torch.Tensor | QuantizedTensor  # a spec ending in Quantize makes a QuantizedTensor
Tensors = dict[str, Loaded]

_READABLE = frozenset(
    {WeightFormat.SAFETENSORS, WeightFormat.PYTORCH, WeightFormat.NUMPY, WeightFormat.RAW, WeightFormat.GGUF}
)
_TRANSFORMATIONS = frozenset({"Transpose", "Reshape", "Cast", "Scale", "Slice", "Dequantize", "Quantize"})


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Results in order; on the first failure the others are cancelled and that error is raised
    (a plain exception, not an ExceptionGroup)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return []
    try:
        done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _finish(reader: OpenedWeights, spec: TensorSpec) -> Loaded:
    """The spec's tensor from an opened object: read, transform, check, move. Blocking."""
    return _moved(_made(reader.tensor(spec.stored_name, spec), spec, where=reader.name), spec)


def _made(tensor: torch.Tensor, spec: TensorSpec, *, where: str) -> Loaded:
    """Transformed (a QuantizedTensor where the spec ends in Quantize) and checked against the spec."""
    made = apply_transformations(tensor, spec.transformations, where=where, name=spec.name)
    check_result(
        made, spec.shape, spec.dtype, where=where, name=spec.name, transformations=spec.transformations
    )
    return made


def _moved(made: Loaded, spec: TensorSpec) -> Loaded:
    """On `spec.device` (for a result returned, not written into a destination)."""
    return made if spec.device == "cpu" and spec.quantize is None else made.to(spec.device)


def _is_plain(spec: TensorSpec) -> bool:
    return not spec.transformations and spec.device == "cpu"


def _nbytes(target: Loaded) -> int:
    return target.nbytes if isinstance(target, QuantizedTensor) else target.numel() * target.element_size()


def _described(target: Loaded) -> str:
    if isinstance(target, QuantizedTensor):
        return f"a QuantizedTensor {target.shape} {target.dtype} in {target.scheme.describe()}"
    return f"{tuple(target.shape)} {target.dtype}{'' if target.is_contiguous() else ' (not contiguous)'}"


def _destination_problem(target: Loaded, spec: TensorSpec) -> str | None:
    """Why `target` cannot take the spec's result (None: it can)."""
    quantize = spec.quantize
    if quantize is None:
        fits = (isinstance(target, torch.Tensor) and tuple(target.shape) == spec.shape
                and target.dtype == spec.dtype and target.is_contiguous())
        return None if fits else f"the spec says {spec.shape} {spec.dtype}"
    expected = f"the spec says a QuantizedTensor {spec.shape} {spec.dtype} in {quantize.scheme.describe()}"
    if not isinstance(target, QuantizedTensor):
        return expected
    problems = target.layout_problems()
    problems += [f"part {name!r} is not contiguous" for name, p in target.parts.items() if not p.is_contiguous()]
    if problems or target.scheme != quantize.scheme or target.shape != spec.shape or target.dtype != spec.dtype:
        return expected + (f" ({'; '.join(problems)})" if problems else "")
    return None


class _Sink:
    """Where `load(into=...)` puts each tensor: its destination, through the device's writer.
    A spec ending in Quantize goes into a QuantizedTensor of destinations, part by part."""

    def __init__(
        self,
        into: Mapping[str, Loaded],
        writer: DeviceWriter,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.into = into
        self.writer = writer
        self._progress = progress
        self._done = 0
        self._total = sum(_nbytes(t) for t in into.values())
        self._lock = threading.Lock()
        self.bytes_read = 0  # of the sources: a whole tensor, or only a slice read as such

    def read_from_source(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def _landed(self, target: Loaded) -> Loaded:
        if self._progress is not None:
            with self._lock:
                self._done += _nbytes(target)
                done = self._done
            self._progress(done, self._total)
        return target

    def check(self, spec: TensorSpec) -> None:
        target = self.into.get(spec.name)
        if target is None:
            raise ValueError(f"load: no destination for {spec.name!r} in `into`")
        problem = _destination_problem(target, spec)
        if problem is not None:
            raise ValueError(f"load: the destination of {spec.name!r} is {_described(target)}, {problem}")

    def put(self, spec: TensorSpec, made: Loaded) -> Loaded:
        """A made (transformed, checked) tensor or QuantizedTensor into its destination."""
        target = self.into[spec.name]
        if isinstance(made, QuantizedTensor):
            assert isinstance(target, QuantizedTensor)  # check() matched it to the spec
            for name, part in made.parts.items():
                self.writer.write_tensor(target.parts[name], part)
        else:
            assert isinstance(target, torch.Tensor)
            self.writer.write_tensor(target, made)
        return self._landed(target)

    def put_stored(self, spec: TensorSpec, stored: StoredBytes, where: str) -> Loaded:
        """Stored bytes straight into the destination, for a spec without transformations."""
        target = self.into[spec.name]
        assert isinstance(target, torch.Tensor)  # a spec without transformations is never quantized
        if stored.dtype != spec.dtype or tuple(stored.shape) != spec.shape:
            raise SpecMismatchError(
                where, f"tensor {spec.name!r}: shape {spec.shape} and dtype {spec.dtype} expected, "
                f"stored as {tuple(stored.shape)} {stored.dtype}"
            )
        self.writer.write(target, stored.read)
        return self._landed(target)


def _finish_into(reader: OpenedWeights, spec: TensorSpec, sink: _Sink) -> Loaded:
    """The spec's tensor into its destination: its stored bytes directly when it needs no
    transformation (or only a leading Slice: then only the slice's bytes are read, as a tensor-
    parallel rank reads its shard, and the rest, a Quantize included, is applied to those) and
    the format has them, else made and checked first. Blocking."""
    steps = spec.transformations
    leading = steps[0] if steps and isinstance(steps[0], Slice) and steps[0].step == 1 else None
    if not steps or leading is not None:
        stored = reader.stored_bytes(spec.stored_name)
        if stored is not None:
            if leading is not None:
                stored = _sliced(stored, leading, reader.name, spec.name)
            sink.read_from_source(stored.nbytes)
            rest = steps[1:] if leading is not None else ()
            if not rest:
                return sink.put_stored(spec, stored, reader.name)
            host = torch.empty(stored.shape, dtype=stored.dtype)
            if host.numel():
                stored.read(host.reshape(-1).view(torch.uint8).numpy().data, 0)
            return sink.put(spec, _made(host, replace(spec, transformations=rest), where=reader.name))
    made = _made(reader.tensor(spec.stored_name, spec), spec, where=reader.name)
    sink.read_from_source(_stored_nbytes(reader, spec))
    return sink.put(spec, made)


def _sliced(stored: StoredBytes, step: Slice, where: str, name: str) -> StoredBytes:
    dim = step.dim % max(len(stored.shape), 1) if -len(stored.shape) <= step.dim < len(stored.shape) else -1
    size = stored.shape[dim] if dim >= 0 else 0
    start, end, _ = slice(step.start, step.end).indices(size)
    if dim < 0:
        raise TransformError(
            where, f"tensor {name!r}: {step!r}: dim {step.dim} is out of range for shape {stored.shape}"
        )
    return stored.sliced(dim, start, max(start, end))


def _stored_nbytes(reader: OpenedWeights, spec: TensorSpec) -> int:
    try:
        stored = reader.stored_bytes(spec.stored_name)
    except Exception:  # noqa: BLE001 - only for the count
        return 0
    return stored.nbytes if stored is not None else 0


def _format_hint_of(source: WeightSource) -> WeightFormat | None:
    """The format the source says or its file name suggests (None: known only from the bytes)."""
    if isinstance(source.format, RawLayout):
        return WeightFormat.RAW
    return source.format or format_from_name(source.filename if not isinstance(source, Memory) else "")


def _is_index(source: WeightSource) -> bool:
    return (
        not isinstance(source, Memory)
        and source.format in (None, WeightFormat.SAFETENSORS, WeightFormat.PYTORCH)
        and is_index_name(source.filename)
    )


class WeightLoader:
    """Loads tensors from `WeightSource`s (see the module docstring). One loader shares its downloader
    (and so the in-flight downloads) between all its calls; close it (`aclose`, `async with`) to
    release the downloader's temporary directory when the cache is disabled."""

    def __init__(self, config: WeightLoaderConfig | None = None) -> None:
        self.bytes_read = 0  # source bytes `load(into=...)` has read so far (a slice counts alone)
        self.config = config or WeightLoaderConfig()
        self._downloader: Downloader | None = None

    def __repr__(self) -> str:
        return f"WeightLoader(cache_dir={str(self.config.cache_dir)!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._downloader is not None:
            self._downloader.close()
            self._downloader = None

    # ------------------------------------------------------------------------------------- public

    def capabilities(self) -> WeightLoaderCapabilities:
        return WeightLoaderCapabilities(
            formats=_READABLE,
            sources=frozenset(cls.kind for cls in (File, Url, HuggingFace, S3, Memory)),
            max_tensor_size_bytes=None,
            streaming=True,
            concurrent=True,
            transformations=_TRANSFORMATIONS,
        )

    async def load_tensor(self, spec: TensorSpec) -> torch.Tensor:
        return (await self.load_tensors([spec]))[spec.name]

    async def load_tensors(
        self,
        specs: Iterable[TensorSpec],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        device: Device | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """`load` for specs that make plain tensors; a spec ending in Quantize is refused (ValueError
        naming it): `load` gives its QuantizedTensor."""
        specs = list(specs)
        for spec in specs:
            if spec.quantize is not None:
                raise ValueError(
                    f"load_tensors: {spec.name!r} ends in {spec.quantize!r}, which makes a QuantizedTensor: "
                    "use WeightLoader.load"
                )
        loaded = await self.load(specs, into=into, device=device, progress=progress)
        return cast(dict[str, torch.Tensor], loaded)  # no spec quantizes: every value is a tensor

    async def load(
        self,
        specs: Iterable[TensorSpec],
        *,
        into: Mapping[str, Loaded] | None = None,
        device: Device | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Tensors:
        """{spec.name: tensor} for all `specs` (names must be unique), in the order given; a spec
        ending in Quantize gives a QuantizedTensor. Every transformation is checked for support
        before any I/O.

        `into` (with `device`, where the destinations live): spec name -> a contiguous tensor of the
        spec's shape and dtype (for a spec ending in Quantize: a QuantizedTensor of its scheme, shape
        and dtype, every part contiguous, e.g. rows of a module's parts), filled in place (see the
        module docstring); the destinations are returned, every upload finished.
        `progress(done_bytes, total_bytes)` is called (from worker threads) as each destination is
        written, counting the destinations' bytes."""
        by_name = specs_by_name(specs)
        for spec in by_name.values():
            for step in spec.transformations:
                step.ensure_supported(where=spec.source.display, name=spec.name)
        sink = None
        if into is not None:
            if device is None:
                raise ValueError("load: `into` needs the device its tensors are on")
            from ferrum.backends.transfer import device_writer

            sink = _Sink(into, device_writer(device), progress)
            for spec in by_name.values():
                sink.check(spec)
        groups: dict[WeightSource, list[TensorSpec]] = {}
        for spec in by_name.values():
            groups.setdefault(object_of(spec.source), []).append(spec)
        try:
            parts = await self._given_up_on_bad_bytes(
                _all(self._load_group(source, group, sink) for source, group in groups.items()))
        finally:
            if sink is not None:
                await asyncio.to_thread(sink.writer.finish)
                self.bytes_read += sink.bytes_read
        merged: Tensors = {}
        for part in parts:
            merged.update(part)
        return {name: merged[name] for name in by_name}

    async def get_metadata(self, source: WeightSource) -> WeightMetadata:
        """What the object holds. SafeTensors over HTTP / S3 / the Hub: read from the header alone
        (8 bytes, then the header); a sharded index: the union of its shards' headers; other remote
        formats are fetched into the cache first."""
        source = object_of(source)
        if isinstance(source, File):
            return await asyncio.to_thread(_local_metadata, source)
        if _is_index(source):
            return await self._index_metadata(source)
        if isinstance(source, Memory):
            return await asyncio.to_thread(
                lambda: open_bytes(source.data, source.format, name=source.display).metadata()
            )
        if isinstance(source, HuggingFace) and _format_hint_of(source) is WeightFormat.SAFETENSORS:
            from ferrum.weights.hub.fetch import hub_metadata

            return await hub_metadata(source, self.config)
        if isinstance(source, (Url, S3)) and _format_hint_of(source) is WeightFormat.SAFETENSORS:
            return await self._remote_header_metadata(source)
        path = await self._fetch(source)
        return await asyncio.to_thread(
            _metadata_of_local, path, source.format, source.display, source.filename
        )

    async def is_available(self, source: WeightSource) -> bool:
        """Whether the object exists and can be reached now (a local file or folder with weights; a
        remote object answering its metadata request; a Hub file cached or on the Hub). Never raises
        a WeightError: a missing, refused or unreachable source is False."""
        source = object_of(source)
        try:
            if isinstance(source, Memory):
                return True
            if isinstance(source, File):
                return await asyncio.to_thread(lambda: _local_file(source).path.is_file())
            if isinstance(source, HuggingFace):
                return await self._hub_available(source)
            obj = self._remote_object(source)
            try:
                await obj.info()
            finally:
                await _close(obj)
            return True
        except WeightError as exc:
            log.debug("%s: not available: %s", source.display, exc)
            return False

    async def preload(self, source: WeightSource) -> Path:
        """Fetch the object into its cache (for an index: with all its shards) and return the local
        path (a local File: its own path). A Memory source has nothing to preload."""
        source = object_of(source)
        if isinstance(source, Memory):
            raise UnsupportedError(source.display, "a Memory source is already in memory: nothing to preload")
        if isinstance(source, File):
            source = await asyncio.to_thread(_existing_local_file, source)
        if _is_index(source):
            path, shards = await self._index(source)
            await self._given_up_on_bad_bytes(
                _all(self.preload(sibling(source, shard)) for shard in dict.fromkeys(shards.values())))
            return path
        if isinstance(source, File):
            return source.path
        return await self._fetch(source)

    @asynccontextmanager
    async def fetching(self, source: WeightSource) -> AsyncIterator[None]:
        """Start downloading `source` now (a remote file, or every shard of a remote index) into
        the cache, without waiting: bytes arrive while the caller prepares (builds the model), and
        `load` inside the block joins these downloads. Leaving the block lets go of them
        (one nobody else joined is cancelled, its partial kept). Nothing for local, Hub or memory
        sources."""
        source = object_of(source)
        started: list[tuple[RemoteObject, Download]] = []
        try:
            if isinstance(source, (Url, S3)):
                files: list[WeightSource] = [source]
                if _is_index(source):
                    _, shards = await self._index(source)
                    files = [sibling(source, shard) for shard in dict.fromkeys(shards.values())]
                for file in files:
                    assert isinstance(file, (Url, S3))
                    obj = self._remote_object(file)
                    try:
                        started.append((obj, await self._get_downloader().open(obj, self._expected_sha256(file))))
                    except BaseException:
                        await _close(obj)
                        raise
            yield
        except IntegrityError:  # a bad file: the partials of these, cancelled now, go too
            for _obj, download in started:
                await download.aclose()
            if self._downloader is not None:
                self._downloader.discard_cancelled()
            raise
        finally:
            for obj, download in started:  # the download first: it reads through its object
                await download.aclose()
                await _close(obj)

    # ------------------------------------------------------------------------------------- groups

    async def _load_group(
        self, source: WeightSource, specs: Sequence[TensorSpec], sink: _Sink | None = None
    ) -> Tensors:
        if isinstance(source, File) and not _is_index(source):
            file = source
            try:
                return await self._load_opened(lambda: _open_file(file), specs, sink)
            except _FolderIndex as folder:
                source = folder.index
        if _is_index(source):
            return await self._load_indexed(source, specs, sink)
        if isinstance(source, Memory):
            return await self._load_opened(
                lambda: open_bytes(source.data, source.format, name=source.display), specs, sink
            )
        if isinstance(source, (Url, S3)) and _format_hint_of(source) is WeightFormat.SAFETENSORS:
            return await self._load_streaming(source, specs, sink)
        path = await self._fetch(source)
        return await self._load_opened(
            lambda: open_local(path, source.format, name=source.display, filename=source.filename), specs, sink
        )

    async def _load_opened(
        self, opener: Callable[[], OpenedWeights], specs: Sequence[TensorSpec], sink: _Sink | None = None
    ) -> Tensors:
        """Open in a thread and make the plain specs there too; the others each in a thread of their
        own. With a sink, every spec goes into its destination from a thread of its own."""

        def open_and_make_plain() -> tuple[OpenedWeights, Tensors]:
            reader = opener()
            if sink is not None:
                return reader, {}
            return reader, {spec.name: _finish(reader, spec) for spec in specs if _is_plain(spec)}

        reader, out = await asyncio.to_thread(open_and_make_plain)
        try:
            if sink is not None:
                made = await _all(asyncio.to_thread(_finish_into, reader, spec, sink) for spec in specs)
                return dict(zip((spec.name for spec in specs), made, strict=True))
            rest = [spec for spec in specs if not _is_plain(spec)]
            made = await _all(asyncio.to_thread(_finish, reader, spec) for spec in rest)
            out.update(zip((spec.name for spec in rest), made, strict=True))
            return out
        finally:
            reader.close()

    async def _load_indexed(
        self, index: WeightSource, specs: Sequence[TensorSpec], sink: _Sink | None = None
    ) -> Tensors:
        """Each spec from the shard the index names for it; the shards' groups are loaded at once."""
        _, shards = await self._index(index)
        by_shard: dict[str, list[TensorSpec]] = {}
        for spec in specs:
            shard = shards.get(spec.stored_name)
            if shard is None:
                raise TensorNotFoundError(index.display, f"the index has no tensor {spec.stored_name!r}")
            by_shard.setdefault(shard, []).append(spec)
        try:
            parts = await _all(
                self._load_group(sibling(index, shard), group, sink) for shard, group in by_shard.items()
            )
        except TensorNotFoundError as exc:
            raise CorruptWeightsError(
                index.display, f"a shard lacks a tensor the index puts in it: {exc}"
            ) from None
        return {name: t for part in parts for name, t in part.items()}

    async def _index(self, index: WeightSource) -> tuple[Path, dict[str, str]]:
        """The index's local path (a remote one is fetched into the cache) and its tensor -> shard map."""
        path = index.path if isinstance(index, File) else await self._fetch(index)
        shards = await asyncio.to_thread(_read_index, path, index.display)
        return path, shards

    async def _index_metadata(self, index: WeightSource) -> WeightMetadata:
        _, shards = await self._index(index)
        files = list(dict.fromkeys(shards.values()))
        metas = await _all(self.get_metadata(sibling(index, shard)) for shard in files)
        return _merged_metadata(index.display, shards, metas)

    # ------------------------------------------------------------------------------------- remote

    async def _given_up_on_bad_bytes(self, work: Awaitable[T]) -> T:
        """`work`'s result; when a file fails verification, the partials its cancelled siblings
        kept for resuming go too (a model with a bad file is not resumed: nothing of it stays)."""
        try:
            return await work
        except IntegrityError:
            if self._downloader is not None:
                self._downloader.discard_cancelled()
            raise

    def _get_downloader(self) -> Downloader:
        if self._downloader is None:
            from ferrum.weights.download.downloader import Downloader

            self._downloader = Downloader(self.config)
        return self._downloader

    def _remote_object(self, source: Url | S3) -> RemoteObject:
        if isinstance(source, Url):
            from ferrum.weights.download.http import HttpObject

            return HttpObject(source.url, source.headers, self.config)
        from ferrum.weights.download.s3 import S3Object

        return S3Object(source, self.config)

    def _expected_sha256(self, source: Url | S3) -> str | None:
        if isinstance(source, Url) and source.sha256:
            return source.sha256
        sums = self.config.expected_sha256
        return sums.get(source.url) if isinstance(source, Url) else sums.get(source.display)

    async def _fetch(self, source: WeightSource) -> Path:
        """A verified local copy of a remote object (huggingface_hub's cache, or ours)."""
        if isinstance(source, HuggingFace):
            from ferrum.weights.hub.fetch import hub_fetch

            return await hub_fetch(source, self.config)
        if isinstance(source, (Url, S3)):
            obj = self._remote_object(source)
            try:
                return await self._get_downloader().fetch(obj, self._expected_sha256(source))
            finally:
                await _close(obj)
        if isinstance(source, File):
            return source.path
        raise UnsupportedError(source.display, "a Memory source has no file to fetch")

    async def _load_streaming(
        self, source: Url | S3, specs: Sequence[TensorSpec], sink: _Sink | None = None
    ) -> Tensors:
        """Make each tensor as soon as its bytes are in the cache's partial file, while the rest of
        the file downloads; return once the whole download is verified."""
        obj = self._remote_object(source)
        try:
            download = await self._get_downloader().open(obj, self._expected_sha256(source))
            async with download, _GrowingFile(download) as file:
                size = download.size

                async def arrived(start: int, end: int) -> None:
                    try:
                        await download.wait_range(start, end)
                    except WeightError:
                        await download.result()  # a failed download: raise its own error (IntegrityError...)
                        raise

                async def read(start: int, end: int) -> bytes:
                    await arrived(start, end)
                    return await file.read(start, end)

                n = header_length(await read(0, min(8, size)), file_size=size, name=source.display)
                raw = await read(8, 8 + n)
                header = await asyncio.to_thread(
                    parse_header, raw, data_size=size - 8 - n, name=source.display
                )
                for spec in specs:
                    if spec.stored_name not in header.tensors:
                        raise TensorNotFoundError(source.display, f"no tensor {spec.stored_name!r}")
                reader_name = source.display

                async def one(spec: TensorSpec) -> Loaded:
                    start, end = header.file_range(spec.stored_name)
                    if sink is not None and not spec.transformations:  # file -> destination, one copy
                        await arrived(start, end)
                        stored = file.stored(header, spec.stored_name, reader_name)
                        sink.read_from_source(stored.nbytes)
                        return await file.run(sink.put_stored, spec, stored, reader_name)
                    data = await read(start, end)
                    if sink is not None:
                        sink.read_from_source(len(data))
                        return await asyncio.to_thread(_streamed_into, data, header, spec, reader_name, sink)
                    return await asyncio.to_thread(_streamed_tensor, data, header, spec, reader_name)

                made = await _all(one(spec) for spec in specs)
                await download.result()  # size / checksum verified, or IntegrityError
                return dict(zip((spec.name for spec in specs), made, strict=True))
        finally:
            await _close(obj)

    async def _remote_header_metadata(self, source: Url | S3) -> WeightMetadata:
        """Two ranged reads, both from byte 0 (a server that ignores Range still answers those)."""
        obj = self._remote_object(source)
        try:
            size = (await obj.info()).size
            n = header_length(await obj.read_range(0, min(8, size)), file_size=size, name=source.display)
            raw = await obj.read_range(0, 8 + n)
        finally:
            await _close(obj)
        return await asyncio.to_thread(_header_metadata, raw[8:], size - 8 - n, source.display)

    async def _hub_available(self, source: HuggingFace) -> bool:
        import huggingface_hub

        from ferrum.weights.hub.settings import hub_settings

        settings = hub_settings(source.cache_dir)

        def check() -> bool:
            cached = huggingface_hub.try_to_load_from_cache(
                source.repo_id, source.filename, cache_dir=settings.cache_dir, revision=source.revision
            )
            if isinstance(cached, str):
                return True
            if settings.offline:
                return False
            api = huggingface_hub.HfApi(endpoint=settings.endpoint)
            return bool(api.file_exists(source.repo_id, source.filename, revision=source.revision))

        try:
            return await asyncio.to_thread(check)
        except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors: not reachable means not available
            log.debug("%s: not available: %s", source.display, exc)
            return False


# ----------------------------------------------------------------------------------------- local files
# Each of these runs in one thread call: a local source costs one hop off the event loop.


class _FolderIndex(Exception):
    """Raised in a thread when a File folder turns out to hold a sharded index (loaded asynchronously)."""

    def __init__(self, index: File) -> None:
        super().__init__(index.display)
        self.index = index


def _local_file(source: File) -> File:
    """A folder's weights file (model.safetensors.index.json / model.safetensors); else `source`."""
    if source.path.is_dir():
        return File(local_weights(source.path).path, format=source.format)
    return source


def _existing_local_file(source: File) -> File:
    target = _local_file(source)
    if not target.path.is_file():
        raise SourceNotFoundError(target.display, "no such file")
    return target


def _open_file(source: File) -> OpenedWeights:
    target = _local_file(source)
    if _is_index(target):
        raise _FolderIndex(target)
    return open_local(target.path, target.format, name=target.display)


def _local_metadata(source: File) -> WeightMetadata:
    target = _local_file(source)
    if not _is_index(target):
        return _metadata_of_local(target.path, target.format, target.display, None)
    shards = _read_index(target.path, target.display)
    files = list(dict.fromkeys(shards.values()))
    metas = [
        _metadata_of_local(target.path.parent / shard, None, str(target.path.parent / shard), None)
        for shard in files
    ]
    return _merged_metadata(target.display, shards, metas)


def _merged_metadata(index: str, shards: dict[str, str], metas: Sequence[WeightMetadata]) -> WeightMetadata:
    """One metadata for a sharded checkpoint, checked to hold every tensor its index names."""
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for meta in metas:
        tensors.update(meta.tensors)
    missing = [t for t in shards if t not in tensors]
    if missing:
        raise CorruptWeightsError(
            index, f"the index puts tensor {missing[0]!r} in {shards[missing[0]]}, which does not hold it"
        )
    return WeightMetadata.of(tensors, metas[0].format, {"shards": str(len(metas))})


def _streamed_made(data: bytes, header: SafetensorsHeader, spec: TensorSpec, name: str) -> Loaded:
    """The tensor of `data` (its bytes, just downloaded), transformed and checked. Blocking."""
    entry = header.tensors[spec.stored_name]
    return _made(tensor_from_bytes(data, entry, name=name), spec, where=name)


def _streamed_tensor(data: bytes, header: SafetensorsHeader, spec: TensorSpec, name: str) -> Loaded:
    """The same, on the spec's device. Blocking."""
    return _moved(_streamed_made(data, header, spec, name), spec)


def _streamed_into(data: bytes, header: SafetensorsHeader, spec: TensorSpec, name: str, sink: _Sink) -> Loaded:
    """Downloaded bytes, transformed and checked, into the spec's destination. Blocking."""
    return sink.put(spec, _streamed_made(data, header, spec, name))


class _GrowingFile:
    """A download's file in the cache (the partial while it grows, the blob once committed: a
    descriptor survives the rename), read in threads; closing waits for every read begun."""

    def __init__(self, download: Download) -> None:
        self._download = download
        self._fd: int | None = None
        self._busy: set[asyncio.Future[Any]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        while self._busy:  # a cancelled await leaves its thread running: let it finish first
            await asyncio.wait(set(self._busy))
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def fd(self) -> int:
        """Opened on first use (after some bytes arrived, so the file exists). The commit may rename the
        partial to the blob at any moment, and the download's `path` names the blob only after it: a
        missing partial is looked for as the blob."""
        if self._fd is None:
            for path in (self._download.path, self._download.blob_path):
                try:
                    self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    break
                except FileNotFoundError:
                    continue
            else:
                raise WeightError(self._download.name, f"the download's file {self._download.path} is gone")
        return self._fd

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._busy.add(future)
        future.add_done_callback(self._busy.discard)
        return await asyncio.shield(future)

    async def read(self, start: int, end: int) -> bytes:
        buffer = bytearray(end - start)
        await self.run(pread_into, self.fd(), memoryview(buffer), start, self._download.name)
        return bytes(buffer)

    def stored(self, header: SafetensorsHeader, tensor: str, name: str) -> StoredBytes:
        """The tensor's bytes, read from the file straight into the reader's buffer."""
        entry = header.tensors[tensor]
        fd, (start, _end) = self.fd(), header.file_range(tensor)

        def pread(buffer: memoryview, offset: int) -> None:
            pread_into(fd, buffer, start + offset, name)

        return StoredBytes(stored_dtype(entry, name), entry.shape, pread)


def _metadata_of_local(path: Path, hint: Any, name: str, filename: str | None) -> WeightMetadata:
    reader = open_local(path, hint, name=name, filename=filename)
    try:
        return reader.metadata()
    finally:
        reader.close()


def _header_metadata(raw: bytes, data_size: int, name: str) -> WeightMetadata:
    return metadata_from_header(parse_header(raw, data_size=data_size, name=name))


def _read_index(path: Path, name: str) -> dict[str, str]:
    return parse_index(_read_local(path, name), name=name)


def _read_local(path: Path, name: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SourceNotFoundError(name, "no such file") from None
    except OSError as exc:
        raise WeightError(name, f"cannot read: {exc.strerror or exc}") from None


async def _close(obj: object) -> None:
    aclose = getattr(obj, "aclose", None)
    if aclose is not None:
        await aclose()

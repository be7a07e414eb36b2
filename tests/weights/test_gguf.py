"""GGUF as a weight format: small files written by gguf-py's GGUFWriter (float tensors, Q8_0 / Q4_0 / Q4_1
quantized by gguf.quants, a K-quant's raw blocks) read through the WeightLoader, corrupt and truncated files,
the demo model's own GGUF; and a GGUF served like a model folder (config, tokenizer, name map, row order)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ferrum.weights import (
    S3,
    CorruptWeightsError,
    File,
    HuggingFace,
    Memory,
    TensorNotFoundError,
    TensorSpec,
    UnsupportedError,
    Url,
    WeightFormat,
    WeightLoader,
    WeightLoaderConfig,
)
from ferrum.weights.formats.gguf import gguf_tensor_types
from ferrum.weights.formats.gguf_model import _llama3_factors
from ferrum.weights.formats.readers import detect_format
from ferrum.weights.gguf_names import gguf_tensor_name, hf_row_order, hf_tensor_name
from ferrum.weights.locations.uri import model_display_name, parse_model_location, resolve_model
from tests.engines import host_device
from tests.fault_server import FaultServer

DEMO_GGUF = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# name -> (logical values, ggml type); the K-quant is random raw blocks (gguf-py cannot quantize to it)
TENSORS: dict[str, tuple[np.ndarray, Q]] = {
    "f32": (_values((3, 5), 0), Q.F32),
    "f16": (_values((2, 3, 4), 1), Q.F16),
    "bf16": (_values((4, 8), 2), Q.BF16),
    "q8_0": (_values((3, 64), 3), Q.Q8_0),
    "q4_0": (_values((2, 2, 32), 4), Q.Q4_0),
    "q4_1": (_values((5, 96), 5), Q.Q4_1),
}
Q6K_RAW = np.random.default_rng(6).integers(0, 256, (2, 210), dtype=np.uint8)  # 2 rows of one 256-value block


def write_gguf(path: Path, tensors: Mapping[str, tuple[np.ndarray, Q]] = TENSORS, *, arch: str = "llama",
               kv: Mapping[str, Any] | None = None, raw: Mapping[str, tuple[np.ndarray, Q]] | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (values, qtype) in tensors.items():
        if qtype is Q.F32:
            writer.add_tensor(name, values)
        elif qtype is Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for name, (blocks, qtype) in (raw or {"q6_k": (Q6K_RAW, Q.Q6_K)}).items():
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "small.gguf")


def raw_rows(values: np.ndarray, qtype: Q) -> np.ndarray:
    """The raw blocks of `values` as rows: [product of all dims but the last, bytes per row]."""
    blocks = gguf.quants.quantize(values, qtype)
    return blocks.reshape(-1, blocks.shape[-1])


# ------------------------------------------------------------------------------------------------ reading


async def test_metadata_names_types_and_shapes(small: Path) -> None:
    meta = await WeightLoader().get_metadata(File(small))
    assert meta.format is WeightFormat.GGUF
    assert meta.tensors["f32"] == ((3, 5), torch.float32)
    assert meta.tensors["f16"] == ((2, 3, 4), torch.float16)  # torch order: GGUF's dims reversed
    assert meta.tensors["bf16"] == ((4, 8), torch.bfloat16)
    assert meta.tensors["q8_0"] == ((3, 2 * 34), torch.uint8)  # 2 blocks of 32 values, 34 bytes each
    assert meta.tensors["q4_0"] == ((4, 18), torch.uint8)  # rows: every dim but the innermost
    assert meta.tensors["q4_1"] == ((5, 3 * 20), torch.uint8)
    assert meta.tensors["q6_k"] == ((2, 210), torch.uint8)
    types = gguf_tensor_types(meta)
    assert types["q4_1"].quantized and not types["f16"].quantized
    assert types["q4_1"] == ("Q4_1", (5, 96)) and types["f16"] == ("F16", (2, 3, 4))
    assert types["q6_k"] == ("Q6_K", (2, 256))
    assert meta.extra["general.architecture"] == "llama"
    assert meta.total_size_bytes == sum(math_prod(shape) * dtype.itemsize for shape, dtype in meta.tensors.values())


def math_prod(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


async def test_float_tensors_and_raw_blocks_are_read(small: Path) -> None:
    loader = WeightLoader()
    meta = await loader.get_metadata(File(small))
    got = await loader.load_tensors([TensorSpec(n, s, d, source=File(small)) for n, (s, d) in meta.tensors.items()])
    assert torch.equal(got["f32"], torch.from_numpy(TENSORS["f32"][0]))
    assert torch.equal(got["f16"], torch.from_numpy(TENSORS["f16"][0].astype(np.float16)))
    assert torch.equal(got["bf16"], torch.from_numpy(TENSORS["bf16"][0]).to(torch.bfloat16))  # round to nearest
    for name in ("q8_0", "q4_0", "q4_1"):
        values, qtype = TENSORS[name]
        rows = got[name].numpy()
        assert np.array_equal(rows, raw_rows(values, qtype)), name
        back = gguf.quants.dequantize(rows, qtype).reshape(values.shape)
        assert np.array_equal(back, gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype))
    assert np.array_equal(got["q6_k"].numpy(), Q6K_RAW)


async def test_raw_rows_go_into_destinations_and_slice_by_rows(small: Path) -> None:
    """`into=`: raw block rows straight into their destination; a row Slice (a tensor-parallel rank) reads
    only its rows."""
    from ferrum.weights import Slice

    expected = torch.from_numpy(raw_rows(*TENSORS["q4_1"]))
    into = {"all": torch.zeros(5, 60, dtype=torch.uint8), "rank1": torch.zeros(2, 60, dtype=torch.uint8)}
    specs = [TensorSpec("all", (5, 60), torch.uint8, source=File(small, tensor_name="q4_1")),
             TensorSpec("rank1", (2, 60), torch.uint8, source=File(small, tensor_name="q4_1"),
                        transformations=(Slice(0, 2, 4),))]
    await WeightLoader().load_tensors(specs, into=into, device=host_device())
    assert torch.equal(into["all"], expected) and torch.equal(into["rank1"], expected[2:4])


def test_detected_by_extension_and_magic(small: Path, tmp_path: Path) -> None:
    assert detect_format("m.gguf", b"", name="x") is WeightFormat.GGUF
    assert detect_format("blob", small.read_bytes()[:16], name="x") is WeightFormat.GGUF


async def test_a_file_without_the_extension_is_detected_by_its_magic(small: Path, tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(small.read_bytes())
    meta = await WeightLoader().get_metadata(File(blob))
    assert meta.format is WeightFormat.GGUF and "q4_1" in meta.tensors


async def test_missing_tensor_and_memory_source_are_refused(small: Path) -> None:
    loader = WeightLoader()
    with pytest.raises(TensorNotFoundError, match="no tensor 'nope'"):
        await loader.load_tensors([TensorSpec("nope", (1,), torch.float32, source=File(small))])
    with pytest.raises(UnsupportedError, match="read from a file"):
        await loader.get_metadata(Memory(small.read_bytes(), WeightFormat.GGUF))


# ----------------------------------------------------------------------------------------- bad files


async def test_truncated_file_names_the_file_and_the_tensor(small: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small.read_bytes()[:-100])  # inside the last tensor's data
    with pytest.raises(CorruptWeightsError) as info:
        await WeightLoader().get_metadata(File(cut))
    assert str(cut) in str(info.value) and "'q6_k'" in str(info.value) and "truncated" in str(info.value)


@pytest.mark.parametrize("keep", [7, 60, 300])
async def test_cut_header_is_corrupt(small: Path, tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small.read_bytes()[:keep])
    with pytest.raises(CorruptWeightsError, match=f"{cut}: not a valid GGUF file"):
        await WeightLoader().load_tensors([TensorSpec("f32", (3, 5), torch.float32, source=File(cut))])


@pytest.mark.parametrize("data, fragment", [(b"", "the file is empty"), (b"GGML" + bytes(60), "not a GGUF file")])
async def test_not_a_gguf_file(tmp_path: Path, data: bytes, fragment: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(CorruptWeightsError, match=fragment):
        await WeightLoader().get_metadata(File(bad))


async def test_unknown_ggml_type_is_named(small: Path, tmp_path: Path) -> None:
    data = bytearray(small.read_bytes())
    name = b"q6_k"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="tensor 'q6_k': ggml type 250"):
        await WeightLoader().get_metadata(File(bad))


# ------------------------------------------------------------------------------------------ the demo file


@pytest.mark.skipif(not DEMO_GGUF.is_file(), reason=f"no {DEMO_GGUF} (scripts/prepare_demo_model.py keeps it)")
async def test_demo_file_metadata_and_raw_rows() -> None:
    loader = WeightLoader()
    meta = await loader.get_metadata(File(DEMO_GGUF))
    types = gguf_tensor_types(meta)
    assert len(meta.tensors) == 272 and "output.weight" not in meta.tensors  # tied embeddings
    assert types["token_embd.weight"] == ("Q8_0", (49152, 576))
    assert types["blk.0.attn_q.weight"] == ("Q4_1", (576, 576))
    assert meta.tensors["blk.0.ffn_down.weight"] == ((576, 1536 // 32 * 20), torch.uint8)
    assert meta.tensors["output_norm.weight"] == ((576,), torch.float32)
    got = await loader.load_tensors([TensorSpec("w", (576, 960), torch.uint8,
                                                source=File(DEMO_GGUF, tensor_name="blk.0.ffn_down.weight"))])
    folder = DEMO_GGUF.with_name("SmolLM2-135M-Instruct") / "model.safetensors"  # converted by transformers
    if folder.is_file():
        from safetensors import safe_open

        with safe_open(str(folder), "pt") as converted:
            reference = converted.get_tensor("model.layers.0.mlp.down_proj.weight")
        values = torch.from_numpy(gguf.quants.dequantize(got["w"].numpy(), Q.Q4_1))
        assert torch.equal(values.to(torch.bfloat16), reference)


# ------------------------------------------------------------------------------------- served as a model


TOKENS = ["<|bos|>", "<|eos|>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "he", "ll", "hell", "hello",
          "Ġw", "<think>"]
TYPES = [3, 3, *[1] * 27, 1, 1, 1, 1, 1, 4]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 32


def model_kv(arch: str = "llama", **extra: Any) -> dict[str, Any]:
    return {
        f"{arch}.block_count": 1, f"{arch}.context_length": 256, f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": 32, f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS, f"{arch}.rope.freq_base": 500000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}<|bos|>{{ m['content'] }}<|eos|>{% endfor %}",
        **extra,
    }


def model_tensors(*, bias: bool = False, output: bool = True) -> dict[str, tuple[np.ndarray, Q]]:
    tensors = {
        "token_embd.weight": (_values((len(TOKENS), HIDDEN), 10), Q.Q8_0),
        "blk.0.attn_q.weight": (_values((HEADS * HEAD_DIM, HIDDEN), 11), Q.F16),
        "blk.0.attn_k.weight": (_values((KV_HEADS * HEAD_DIM, HIDDEN), 12), Q.F16),
        "output_norm.weight": (_values((HIDDEN,), 13), Q.F32),
    }
    if bias:
        tensors["blk.0.attn_q.bias"] = (_values((HEADS * HEAD_DIM,), 14), Q.F32)
    if output:
        tensors["output.weight"] = (_values((len(TOKENS), HIDDEN), 15), Q.Q8_0)
    return tensors


async def test_gguf_file_resolves_like_a_model_folder(tmp_path: Path) -> None:
    from ferrum.models.config import load_model_config
    from ferrum.tokenizer.tokenizer import Tokenizer

    path = write_gguf(tmp_path / "Tiny-Model.Q8_0.gguf", model_tensors(), kv=model_kv(), raw={})
    config = WeightLoaderConfig(cache_dir=tmp_path / "cache")
    files = await resolve_model(str(path), config)
    assert files.weights == File(path) and files.complete
    assert files.folder.parent == tmp_path / "cache" / "models"
    assert files.folder.name.startswith("gguf--Tiny-Model.Q8_0--")
    model = load_model_config(files.folder)
    assert (model.architecture, model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads) == (
        "LlamaForCausalLM", HIDDEN, 1, HEADS, KV_HEADS)
    assert (model.head_dim, model.rope.theta, model.max_position_embeddings, model.vocab_size) == (
        HEAD_DIM, 500000.0, 256, len(TOKENS))
    assert model.rms_norm_eps == pytest.approx(1e-5) and not model.tie_word_embeddings
    assert (model.bos_token_id, model.eos_token_ids, model.dtype) == (0, (1,), torch.bfloat16)
    tokenizer = Tokenizer.from_folder(files.folder)
    ids = tokenizer.encode("hello<think> w")
    assert ids == [0, TOKENS.index("hello"), TOKENS.index("<think>"), TOKENS.index("Ġw")]  # BOS added once
    assert tokenizer.decode(ids) == "hello<think> w"
    assert tokenizer.encode_chat([{"role": "user", "content": "hello"}]) == [0, TOKENS.index("hello"), 1]
    assert tokenizer.eos_token_ids == frozenset({1})
    again = await resolve_model(str(path), config)  # found, not made again
    assert again.folder == files.folder
    os.utime(path, ns=(1, 1))  # a changed file gets a folder of its own
    assert (await resolve_model(str(path), config)).folder != files.folder


async def test_tied_embeddings_bias_and_qwen3_head_dim(tmp_path: Path) -> None:
    from ferrum.models.config import load_model_config

    tensors = {**model_tensors(bias=True, output=False), "blk.0.attn_q_norm.weight": (_values((HEAD_DIM,), 16), Q.F32)}
    kv = model_kv("qwen3", **{"qwen3.attention.key_length": HEAD_DIM})
    path = write_gguf(tmp_path / "q.gguf", tensors, arch="qwen3", kv=kv, raw={})
    model = load_model_config((await resolve_model(str(path), WeightLoaderConfig(cache_dir=tmp_path))).folder)
    assert model.architecture == "Qwen3ForCausalLM" and model.qk_norm and model.head_dim == HEAD_DIM
    assert model.tie_word_embeddings and model.attention_bias


@pytest.mark.parametrize("arch, kv, fragment", [
    ("phi3", {}, "GGUF architecture 'phi3' is not served"),
    ("llama", {"tokenizer.ggml.model": "t5"}, "'t5' is a tokenizer model Ferrum does not build"),
])
async def test_unsupported_models_are_refused_by_name(tmp_path: Path, arch: str, kv: dict[str, Any],
                                                      fragment: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", model_tensors(), arch=arch, kv={**model_kv(arch), **kv}, raw={})
    with pytest.raises(UnsupportedError, match=fragment) as info:
        await resolve_model(str(path), WeightLoaderConfig(cache_dir=tmp_path))
    assert str(path) in str(info.value)


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path: Path) -> None:
    from ferrum.weights.formats.gguf import gguf_header
    from ferrum.weights.formats.gguf_model import gguf_config

    table = _llama3_factors(500000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    tensors = {**model_tensors(), "rope_freqs.weight": (table, Q.F32)}
    path = write_gguf(tmp_path / "l3.gguf", tensors, kv=model_kv(), raw={})
    scaling = gguf_config(gguf_header(path), path)["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    odd = write_gguf(tmp_path / "odd.gguf", {**model_tensors(), "rope_freqs.weight": (table[::-1].copy(), Q.F32)},
                     kv=model_kv(), raw={})
    with pytest.raises(UnsupportedError, match="'rope_freqs.weight': a rope frequency table that is not Llama 3's"):
        gguf_config(gguf_header(odd), odd)


def test_tensor_names_map_both_ways() -> None:
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.7.attn_norm.weight": "model.layers.7.input_layernorm.weight",
        "blk.7.ffn_norm.weight": "model.layers.7.post_attention_layernorm.weight",
        "blk.7.attn_q.bias": "model.layers.7.self_attn.q_proj.bias",
        "blk.7.attn_output.weight": "model.layers.7.self_attn.o_proj.weight",
        "blk.7.attn_k_norm.weight": "model.layers.7.self_attn.k_norm.weight",
        "blk.7.ffn_gate.weight": "model.layers.7.mlp.gate_proj.weight",
        "blk.7.ffn_down.weight": "model.layers.7.mlp.down_proj.weight",
    }
    for ours, hf in pairs.items():
        assert hf_tensor_name(ours) == hf and gguf_tensor_name(hf) == ours
    assert hf_tensor_name("rope_freqs.weight") is None and gguf_tensor_name("model.rotary_emb.inv_freq") is None


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (n_head: the heads of this tensor)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_row_order_undoes_llama_cpp_permute() -> None:
    hf_q, hf_k = torch.randn(HEADS * HEAD_DIM, HIDDEN), torch.randn(KV_HEADS * HEAD_DIM)  # a weight and a bias
    def order(name: str, rows: int, architecture: str = "llama") -> torch.Tensor | None:
        return hf_row_order(name, rows, architecture=architecture, num_heads=HEADS, num_kv_heads=KV_HEADS)

    q_order, k_order = order("blk.0.attn_q.weight", HEADS * HEAD_DIM), order("blk.0.attn_k.bias", KV_HEADS * HEAD_DIM)
    assert q_order is not None and k_order is not None
    assert torch.equal(llama_cpp_permute(hf_q, HEADS)[q_order], hf_q)
    assert torch.equal(llama_cpp_permute(hf_k, KV_HEADS)[k_order], hf_k)
    assert order("blk.0.attn_v.weight", 16) is None and order("blk.0.attn_q.weight", 32, "qwen2") is None


@pytest.mark.parametrize("text, expected, name", [
    ("models/x/Demo.Q4_1.gguf", File(Path("models/x/Demo.Q4_1.gguf")), "Demo.Q4_1"),
    ("https://h/m/Demo.gguf?sig=1", Url("https://h/m/Demo.gguf?sig=1"), "Demo"),
    ("s3://bkt/m/Demo.gguf", S3("bkt", "m/Demo.gguf"), "Demo"),
    ("hf://org/repo@v2/sub/Demo.gguf", HuggingFace("org/repo", "sub/Demo.gguf", "v2"), "Demo"),
    ({"source": "hf", "repo": "org/repo", "file": "Demo.gguf"}, HuggingFace("org/repo", "Demo.gguf"), "Demo"),
    ({"source": "url", "url": "https://h/Demo.gguf", "sha256": {"Demo.gguf": "ab" * 32}},
     Url("https://h/Demo.gguf", sha256="ab" * 32), "Demo"),
])
def test_gguf_locations_are_parsed(text: object, expected: object, name: str) -> None:
    assert parse_model_location(text) == expected  # type: ignore[arg-type]
    assert model_display_name(text) == name  # type: ignore[arg-type]


async def test_gguf_over_http_is_fetched_into_the_cache(tmp_path: Path, fault_server: FaultServer) -> None:
    """A URL naming a .gguf: fetched whole into the download cache, read from there."""
    path = write_gguf(tmp_path / "m.gguf", model_tensors(), kv=model_kv(), raw={})
    fault_server.files["x/m.gguf"] = path.read_bytes()
    config = WeightLoaderConfig(cache_dir=tmp_path / "cache")
    files = await resolve_model(fault_server.url("/x/m.gguf"), config)
    assert isinstance(files.weights, File) and files.weights.format is WeightFormat.GGUF
    assert files.weights.path.read_bytes() == path.read_bytes()
    assert json.loads((files.folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loader = WeightLoader(config)
    meta = await loader.get_metadata(files.weights)
    assert gguf_tensor_types(meta)["token_embd.weight"] == ("Q8_0", (len(TOKENS), HIDDEN))
    remote = Url(fault_server.url("/x/m.gguf"))  # the WeightLoader itself: fetched into the cache, then as a File
    assert (await loader.get_metadata(remote)).tensors == meta.tensors
    got = await loader.load_tensors([TensorSpec("norm", (HIDDEN,), torch.float32,
                                                source=Url(remote.url, tensor_name="output_norm.weight"))])
    assert torch.equal(got["norm"], torch.from_numpy(model_tensors()["output_norm.weight"][0]))
    await loader.aclose()

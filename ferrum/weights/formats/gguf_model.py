"""A GGUF file as a model folder: the files Ferrum serves from (config.json, tokenizer.json,
tokenizer_config.json, generation_config.json), made from its metadata, and the map from its tensor
names and row layout to the Hugging Face checkpoint's.

Derived as transformers' own GGUF loader derives them (transformers 5: modeling_gguf_pytorch_utils,
integrations/ggml.py and integrations/gguf; tests/weights/test_gguf_transformers.py checks the demo
file against it):

    architecture   general.architecture llama -> LlamaForCausalLM (MistralForCausalLM when general.name
                   is "mistral", as transformers reads it), qwen2 -> Qwen2ForCausalLM, qwen3 ->
                   Qwen3ForCausalLM; any other is refused by name (UnsupportedError)
    config.json    from <arch>.*: context_length, block_count, feed_forward_length, embedding_length,
                   attention.head_count(_kv), attention.layer_norm_rms_epsilon, rope.freq_base,
                   vocab_size (else the token count); tie_word_embeddings when there is no
                   output.weight; bos/eos/unk/pad ids from tokenizer.ggml.*
    tokenizer      tokenizer.ggml.model "gpt2" (byte-level BPE: Llama 3, Qwen, SmolLM): tokens, merges,
                   the split of tokenizer.ggml.pre, CONTROL tokens special, USER_DEFINED ones added,
                   BOS/EOS added per tokenizer.ggml.add_bos/eos_token. "llama" (SentencePiece: Llama
                   2, Mistral, TinyLlama): the tokens as they are spelled ("▁" for a space), merges
                   from the file or else derived from tokenizer.ggml.scores (every split of a token
                   into two tokens, ranked by the whole token's score: llama.cpp's highest-score-first
                   merging, as transformers rebuilds it), bytes no token covers as <0xXX> tokens, "▁"
                   before the first word unless tokenizer.ggml.add_space_prefix is false, BOS added
                   unless add_bos_token says otherwise. Other tokenizer models are refused by name.
    tokenizer_config.json   bos/eos/unk/pad tokens, add_bos/eos_token, chat template(s) (tokenizer.chat_template,
                   and tokenizer.chat_template.<name> as named templates)
    generation_config.json  bos/eos/pad ids

Where transformers leaves a value to its config class's defaults, or drops what the file says, this
reads the file (each differs from transformers only for files the demo is not): head_dim from
attention.key_length, else rope.dimension_count (llama), else attn_q's rows / heads;
attention_bias from whether attn_q.bias exists; rope scaling from rope.scaling.type (linear, and yarn,
which Ferrum's config refuses by name) and, for Llama 3.x files, the llama3 parameters recovered from
the rope_freqs.weight table llama.cpp's converter writes instead (a table they do not produce is
refused); "dtype" the file's float type (F32 -> float32, F16 -> float16), bfloat16 for BF16 and
quantized files.

Tensors keep their GGUF names; ferrum.weights.gguf_names maps them to HF's (and gives the row order
llama.cpp's converter changed). config.json's quantization_config {"quant_method": "gguf", "architecture",
"tensor_types": {HF tensor name: ggml type}} tells the model loader how each is stored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from ferrum.weights.errors import CorruptWeightsError, UnsupportedError
from ferrum.weights.formats.gguf import GGUFHeader
from ferrum.weights.gguf_names import hf_tensor_name

__all__ = [
    "GGUF_ARCHITECTURES",
    "gguf_config",
    "gguf_generation_config",
    "gguf_model_files",
    "gguf_tokenizer",
    "gguf_tokenizer_config",
]

# general.architecture -> (model_type, HF architecture); llama files named "mistral" are Mistral (as transformers)
GGUF_ARCHITECTURES: Mapping[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_MISTRAL = ("mistral", "MistralForCausalLM")
# ------------------------------------------------------------------------------------------- config


def _architecture(header: GGUFHeader) -> tuple[str, str, str]:
    """(general.architecture, model_type, HF architecture); UnsupportedError naming any other."""
    arch = header.kv.get("general.architecture")
    if not isinstance(arch, str):
        raise CorruptWeightsError(header.name, "no general.architecture: the GGUF names no model architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedError(
            header.name, f"GGUF architecture {arch!r} is not served by Ferrum; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3)"
        )
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and header.kv.get("general.name") == "mistral":
        model_type, hf_arch = _MISTRAL
    return arch, model_type, hf_arch


def _required(header: GGUFHeader, key: str) -> Any:
    if key not in header.kv:
        raise CorruptWeightsError(header.name, f"no {key} in the GGUF metadata: the model's shape is incomplete")
    return header.kv[key]


def _checkpoint_dtype(header: GGUFHeader) -> str:
    types = {t.ggml_type for t in header.tensors.values() if len(t.logical_shape) == 2}
    if types == {GGMLQuantizationType.F32}:
        return "float32"
    if types <= {GGMLQuantizationType.F16, GGMLQuantizationType.F32} and types:
        return "float16"
    return "bfloat16"


def _head_dim(header: GGUFHeader, arch: str, heads: int) -> int | None:
    keys = [f"{arch}.attention.key_length", *([f"{arch}.rope.dimension_count"] if arch == "llama" else [])]
    for key in keys:
        if key in header.kv:
            return int(header.kv[key])
    q = header.tensors.get("blk.0.attn_q.weight")
    return q.logical_shape[0] // heads if q is not None and heads else None


def _rope_scaling(header: GGUFHeader, path: Path, arch: str, theta: float, head_dim: int | None) -> dict[str, Any]:
    kind = header.kv.get(f"{arch}.rope.scaling.type")
    factor = header.kv.get(f"{arch}.rope.scaling.factor")
    original = header.kv.get(f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor is not None:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return {"rope_scaling": scaling}
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is None or head_dim is None:
        return {}
    if freqs.ggml_type is not GGMLQuantizationType.F32 or freqs.logical_shape != (head_dim // 2,):
        raise UnsupportedError(
            header.name, f"tensor 'rope_freqs.weight': a {freqs.ggml_type.name} {freqs.logical_shape} rope frequency "
            f"table; only the F32 [{head_dim // 2}] table of Llama 3 rope scaling is understood"
        )
    table = np.fromfile(path, dtype=np.float32, count=head_dim // 2, offset=freqs.offset)
    return {"rope_scaling": _llama3_rope(table, theta, head_dim, int(original or 8192), header.name)}


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The table llama.cpp's converter writes for Llama 3 rope scaling (convert_hf_to_gguf.py, LlamaModel)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))


def _llama3_rope(table: np.ndarray, theta: float, head_dim: int, original: int, name: str) -> dict[str, Any]:
    """The llama3 rope parameters that give `table` (those of Llama 3.1 to 3.3: low 1, high 4)."""
    factor = float(table.max())
    low, high = 1.0, 4.0
    if np.allclose(table, _llama3_factors(theta, head_dim, factor, low, high, original), rtol=1e-5, atol=1e-6):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original}
    raise UnsupportedError(
        name, "tensor 'rope_freqs.weight': a rope frequency table that is not Llama 3's (factor "
        f"{factor}, low 1, high 4, {original} original positions): its rope scaling cannot be served"
    )


def gguf_config(header: GGUFHeader, path: Path) -> dict[str, Any]:
    """config.json of the GGUF file at `path` (the module docstring says from what)."""
    arch, model_type, hf_arch = _architecture(header)
    kv = header.kv
    heads = int(_required(header, f"{arch}.attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": int(_required(header, f"{arch}.embedding_length")),
        "intermediate_size": int(_required(header, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(header, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv.get(f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(_required(header, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "dtype": _checkpoint_dtype(header),
    }
    head_dim = _head_dim(header, arch, heads)
    if head_dim is not None:
        config["head_dim"] = head_dim
    if f"{arch}.attention.layer_norm_rms_epsilon" in kv:
        config["rms_norm_eps"] = float(kv[f"{arch}.attention.layer_norm_rms_epsilon"])
    theta = float(kv.get(f"{arch}.rope.freq_base", 10000.0))
    if f"{arch}.rope.freq_base" in kv:
        config["rope_theta"] = theta
    config.update(_rope_scaling(header, path, arch, theta, head_dim))
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab = kv.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise CorruptWeightsError(header.name, f"no {arch}.vocab_size nor tokenizer.ggml.tokens: the vocabulary's size")
    config["vocab_size"] = int(vocab)
    config.update(_special_ids(header))
    # what the weights are stored as, for the model loader (ferrum.weights.quantization.published.gguf)
    types = {hf: t.ggml_type.name for t in header.tensors.values() if (hf := hf_tensor_name(t.name)) is not None}
    config["quantization_config"] = {"quant_method": "gguf", "architecture": arch, "tensor_types": types}
    return config


def _special_ids(header: GGUFHeader) -> dict[str, int]:
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unk_token_id": "unknown_token_id",
            "pad_token_id": "padding_token_id"}
    return {ours: int(header.kv[f"tokenizer.ggml.{theirs}"]) for ours, theirs in keys.items()
            if f"tokenizer.ggml.{theirs}" in header.kv}


def gguf_generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special ids of config.json that generation uses."""
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}


# ---------------------------------------------------------------------------------------------- tokenizer

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split its merges were learned on (transformers' GGUF_PRE_TOKENIZER_SPLITS); any
# other pre-tokenizer (gpt2, smollm, ...) keeps byte-level BPE's own GPT-2 split
_PRE_TOKENIZER_SPLITS: Mapping[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_NAMED_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                 "pad_token": "padding_token_id"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (transformers' bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _string_list(header: GGUFHeader, key: str) -> list[str]:
    value = header.kv.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CorruptWeightsError(header.name, f"{key} is missing or not a list of strings")
    return value


def gguf_tokenizer(header: GGUFHeader) -> Tokenizer:
    """The tokenizer that tokenizer.ggml.* describe (byte-level BPE or SentencePiece; see the module docstring)."""
    model = header.kv.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedError(
            header.name, f"tokenizer.ggml.model {model!r} is a tokenizer model Ferrum does not build: byte-level "
            "BPE ('gpt2': Llama 3, Qwen, SmolLM) and SentencePiece ('llama': Llama 2, Mistral) are built from a "
            "GGUF; serve the model's folder with its tokenizer.json instead"
        )
    tokens = _string_list(header, "tokenizer.ggml.tokens")
    if model == "llama":
        tokenizer, vocab = _sentencepiece(header, tokens), set(tokens)
        alphabet = None
    else:
        tokenizer, vocab, alphabet = _byte_level(header, tokens)
    types = header.kv.get("tokenizer.ggml.token_type") or []
    # a CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it too)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(tokens, types, strict=False)
                                  if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in vocab])
    named = _named_tokens(header, tokens)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named.values()])
    tokenizer.post_processor = _post_processor(header, tokenizer, named)
    return tokenizer


def _byte_level(header: GGUFHeader, tokens: list[str]) -> tuple[Tokenizer, set[str], set[str]]:
    """Byte-level BPE: the tokenizer, its vocabulary as spelled, and the byte alphabet."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges: list[tuple[str, str]] = []
    for merge in _string_list(header, "tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise CorruptWeightsError(header.name, f"tokenizer.ggml.merges: {merge!r} is not two tokens")
        merges.append((pair[0], pair[1]))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(str(header.kv.get("tokenizer.ggml.pre")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, set(vocab), alphabet


def _sentencepiece(header: GGUFHeader, tokens: list[str]) -> Tokenizer:
    """SentencePiece as llama.cpp runs it ("llama"): BPE over the tokens as spelled, with byte fallback."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    if "tokenizer.ggml.merges" in header.kv:
        for merge in _string_list(header, "tokenizer.ggml.merges"):
            pair = merge.split(" ")
            if len(pair) != 2:
                raise CorruptWeightsError(header.name, f"tokenizer.ggml.merges: {merge!r} is not two tokens")
            merges.append((pair[0], pair[1]))
    else:
        scores = header.kv.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
                isinstance(v, (int, float)) for v in scores):
            raise CorruptWeightsError(header.name, f"tokenizer.ggml.scores is missing or not {len(tokens)} numbers "
                                      "(a SentencePiece vocabulary without merges needs them)")
        merges = _merges_by_score(vocab, dict(zip(tokens, (float(v) for v in scores), strict=True)))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True))
    prefix = bool(header.kv.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                       prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tokenizer


def _merges_by_score(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, best first: by the whole token's score,
    then the longer left and right parts; one token's splits by their parts' ids (the order transformers
    gives them)."""
    ranked: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:], score) for i in range(1, len(token))
                  if token[:i] in vocab and token[i:] in vocab]
        ranked.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _named_tokens(header: GGUFHeader, tokens: Sequence[str]) -> dict[str, str]:
    named: dict[str, str] = {}
    for name, key in _NAMED_TOKENS.items():
        index = header.kv.get(f"tokenizer.ggml.{key}")
        if index is None:
            continue
        if not 0 <= int(index) < len(tokens):
            raise CorruptWeightsError(header.name, f"tokenizer.ggml.{key} {index} is outside the vocabulary")
        named[name] = tokens[int(index)]
    return named


def _add_flags(header: GGUFHeader) -> dict[str, bool]:
    flags = {f"add_{which}_token": bool(header.kv[f"tokenizer.ggml.add_{which}_token"])
             for which in ("bos", "eos") if f"tokenizer.ggml.add_{which}_token" in header.kv}
    if header.kv.get("tokenizer.ggml.model") == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary
        flags.setdefault("add_bos_token", True)  # that does not say otherwise (older files have no flag)
    return flags


def _post_processor(header: GGUFHeader, tokenizer: Tokenizer, named: Mapping[str, str]) -> processors.PostProcessor:
    """BOS / EOS around each sequence as tokenizer.ggml.add_bos/eos_token say (transformers' TemplateProcessing)."""
    flags = _add_flags(header)
    bos = named.get("bos_token") if flags.get("add_bos_token") else None
    eos = named.get("eos_token") if flags.get("add_eos_token") else None
    first = f"{bos}:0 " if bos else ""
    last = f" {eos}:0" if eos else ""
    single = f"{first}$A:0{last}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def gguf_tokenizer_config(header: GGUFHeader) -> dict[str, Any]:
    """tokenizer_config.json: the named special tokens, the BOS/EOS flags and the chat template(s)."""
    tokens = _string_list(header, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {**_named_tokens(header, tokens), **_add_flags(header)}
    template = header.kv.get("tokenizer.chat_template")
    named = {key.removeprefix("tokenizer.chat_template."): value for key, value in header.kv.items()
             if key.startswith("tokenizer.chat_template.") and isinstance(value, str)}
    if named:
        default = [{"name": "default", "template": template}] if isinstance(template, str) else []
        config["chat_template"] = default + [{"name": n, "template": t} for n, t in named.items()]
    elif isinstance(template, str):
        config["chat_template"] = template
    return config


# ------------------------------------------------------------------------------------------- the folder


def gguf_model_files(header: GGUFHeader, path: Path) -> dict[str, str]:
    """{file name: text} of the model folder files the GGUF file at `path` stands for."""
    config = gguf_config(header, path)
    return {
        "config.json": _json(config),
        "generation_config.json": _json(gguf_generation_config(config)),
        "tokenizer.json": gguf_tokenizer(header).to_str(),
        "tokenizer_config.json": _json(gguf_tokenizer_config(header)),
    }


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"

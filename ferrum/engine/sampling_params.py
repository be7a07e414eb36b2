"""What a request asks of the sampler and of the stop checks, and the grammar its output must follow
(`StructuredOutput`, compiled and enforced by ferrum.engine.structured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StructuredKind = Literal["json", "regex", "choice", "grammar"]


class SamplingParamsError(ValueError):
    """An out-of-range sampling parameter; `param` names the API field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` json: `spec` is a JSON schema (text); regex: a regular expression; choice: a JSON list of
    strings; grammar: a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's, told by `::=`).
    `param`: the request field it came from, for error messages."""

    kind: StructuredKind
    spec: str
    param: str = "structured_outputs"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # over prompt and output tokens, as in HF/vLLM
    presence_penalty: float = 0.0  # over output tokens, as in OpenAI
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: chosen token only; N: also the top N
    # None: off; 0: each prompt token's own logprob (the first has none); N: also the top N at each position.
    # The prefill then computes logits at every prompt position, and skips the prefix cache (as vLLM).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias, -100 to 100)
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # a grammar every output token must follow
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{param} {msg}", param)

        check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
            "logprobs",
            f"must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}",
        )
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}",
        )
        check(len(self.stop) <= 16, "stop", f"may hold at most 16 strings, got {len(self.stop)}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "strings must be non-empty")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative token ids")
        check(all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias",
              "values must be between -100 and 100")
        check(all(t >= 0 for t, _ in self.logit_bias), "logit_bias", "keys must be non-negative token ids")
        if self.seed is not None:
            check(-(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits")

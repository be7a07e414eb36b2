"""`SpeculativeConfig`: how a served model speculates (the `speculative_config` of the engine section, or
`--speculative-config` as JSON, with vLLM's names)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)  # the proposers that need no second model; draft models and EAGLE heads come next
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: the proposer ("ngram": prompt lookup). num_speculative_tokens: the most tokens drafted a step
    for one sequence (k). prompt_lookup_min / _max: the n-gram lengths matched, longest first.
    disable_by_batch_size: no drafts while this many sequences or more are running (vLLM's manual
    override; None: the policy decides alone). adaptive: draft only where the measured acceptance and the
    measured cost of the extra tokens say it pays (ferrum.engine.speculative.policy); false: draft
    whenever the proposer has something."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not one Ferrum runs; valid methods: "
                             f"{', '.join(METHODS)} (draft models and EAGLE heads are not built yet)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, raw: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the YAML mapping or the flag's JSON text (None, "" or "null": no speculation); ValueError
        naming an unknown key or a bad value."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if isinstance(raw, str):
            if not raw.strip() or raw.strip() == "null":
                return None
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
            if raw is None:
                return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a mapping, e.g. {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; valid keys: "
                             f"{', '.join(sorted(known))}")
        return cls(**dict(raw))

"""The GPU runner's choice of path for a step, as plain rules (no GPU needed): which prompt chunks replay the
decode graph a row a token (ferrum.engine.gpu_runner.prompt_keys against KernelConfig.graph_prompt_keys)."""

from __future__ import annotations

import pytest

from ferrum.engine.gpu_runner import prompt_keys
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.kernels.config import KernelConfig

ROWS_PROMPT_KEYS = KernelConfig().graph_prompt_keys


def _seq(tokens: int, computed: int) -> Sequence:
    seq = Sequence("r", list(range(tokens)), SamplingParams(max_tokens=8), 0.0)
    seq.num_computed_tokens = computed
    return seq


def test_short_prompts_replay_the_graph_and_long_chunks_after_long_contexts_do_not() -> None:
    fresh = ScheduledSequence(_seq(250, 0), 250)  # each row attends to itself and the rows before it
    assert prompt_keys([fresh]) == 250 * 251 // 2 <= ROWS_PROMPT_KEYS
    after_prefix = ScheduledSequence(_seq(2100, 2000), 100)
    assert prompt_keys([after_prefix]) == 100 * 2000 + 100 * 101 // 2 > ROWS_PROMPT_KEYS
    # decodes and drafts (a verify step's rows) count nothing, at any context length
    decode = ScheduledSequence(_seq(5001, 5000), 1)
    draft = ScheduledSequence(_seq(5001, 5000), 5, (1, 2, 3, 4))
    assert prompt_keys([decode, draft]) == 0
    assert prompt_keys([fresh, decode, draft]) == prompt_keys([fresh])


@pytest.mark.parametrize("bad", [-1, True, 1.5, "many"])
def test_a_bad_graph_prompt_keys_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="kernels.graph_prompt_keys"):
        KernelConfig.from_mapping({"graph_prompt_keys": bad})

"""Speculative decoding: a proposer drafts up to k tokens for a decoding sequence, the target model
verifies every draft of the step in its one forward pass, and rejection sampling keeps the tokens the
target would have produced (the target's distribution exactly; under greedy decoding the same tokens).

    config.py    SpeculativeConfig: `--speculative-config '{"method": "ngram", ...}'`, as vLLM's users write it
    proposer.py  the Proposer seam, and the n-gram (prompt-lookup) proposer
    policy.py    when to draft and how much: per sequence and per step, from the measured acceptance and
                 the measured cost of a step's tokens (never slower under load)
    verify.py    rejection sampling of the drafts against the target's logits, position by position, with
                 every sampling setting (penalties, logit bias, grammars, top-k/p) as a plain decode
"""

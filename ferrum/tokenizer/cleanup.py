"""HF's `clean_up_tokenization_spaces`, for whole texts and for streamed text.

The clean-up deletes the space before some punctuation and English contractions (" ." -> ".",
" n't" -> "n't", ...). It only matters for tokenizers that set the flag and are not BPE; HF
skips it for BPE models.
"""

from __future__ import annotations

# Applied in this order, each over the whole text, like HF's chain of str.replace calls.
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_LONGEST = max(len(old) for old, _ in _REPLACEMENTS)

# If a safe head ended with one of these, a later pass could join it to text still to come: the
# space of " ' " may be the first char of the rest, and " n" + "'t" (left by " ' " -> "'") makes " n't".
_UNSAFE_ENDINGS: tuple[str, ...] = (" ", " '", " n")


def clean_up_tokenization(text: str) -> str:
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    return text


def safe_split(text: str) -> int:
    """The largest `cut` such that clean_up(text[:cut] + rest) == clean_up(text[:cut]) + clean_up(rest)
    for every `rest` that continues `text` (so `rest` starts with `text[cut:]`).

    Every pattern starts with a space and is at most 4 chars long, so a replacement can only reach
    across the cut from a space in the last 3 chars of the head. With no space there the cut is safe.
    A cut just before a space is also safe unless the head has one of `_UNSAFE_ENDINGS`.
    """
    for cut in range(len(text), 0, -1):
        head = text[:cut]
        if " " not in head[-(_LONGEST - 1) :]:
            return cut
        if cut < len(text) and text[cut] == " " and not head.endswith(_UNSAFE_ENDINGS):
            return cut
    return 0


class CleanupStream:
    """Applies the clean-up to text that arrives in pieces: the pieces it returns, joined, equal
    `clean_up_tokenization` of all the text pushed, once `flush` has been called."""

    def __init__(self) -> None:
        self._held = ""

    def push(self, text: str) -> str:
        self._held += text
        cut = safe_split(self._held)
        head, self._held = self._held[:cut], self._held[cut:]
        return clean_up_tokenization(head)

    def flush(self) -> str:
        head, self._held = self._held, ""
        return clean_up_tokenization(head)

"""Tokenization for serving: text <-> ids, chat templates, streaming detokenization."""

from ferrum.tokenizer.chat_template import ChatTemplateError
from ferrum.tokenizer.incremental import IncrementalDecoder
from ferrum.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDecoder", "Tokenizer"]

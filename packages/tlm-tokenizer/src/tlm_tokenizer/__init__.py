"""Byte-level BPE: a fast pure-Python trainer and a GPT-2-exact tokenizer, with no torch."""

from tlm_tokenizer.encode_file import encode_file
from tlm_tokenizer.gpt2_format import bytes_to_unicode
from tlm_tokenizer.pretokenize import GPT2_PATTERN
from tlm_tokenizer.tokenizer import Tokenizer
from tlm_tokenizer.train import train_bpe

__version__ = "0.1.0"

__all__ = ["GPT2_PATTERN", "Tokenizer", "__version__", "bytes_to_unicode", "encode_file", "train_bpe"]

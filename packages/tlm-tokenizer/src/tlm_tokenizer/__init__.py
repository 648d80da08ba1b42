"""Byte-level BPE: a fast pure-Python trainer and a GPT-2-exact tokenizer, with no torch.

Names load on first use (PEP 562), so ``from tlm_tokenizer import train_bpe`` imports the trainer
alone: importing the encoder too (its file handling pulls in ``tlm_core.atomic``, ``json``,
``pathlib``, ``secrets``) would add about as much time again as the trainer's own imports, a sizeable
part of a course-sized training run. ``tests/test_imports.py`` holds this.
"""

from typing import TYPE_CHECKING

from tlm_core.lazy import lazy_exports

__version__ = "0.3.0"

__all__ = ["GPT2_PATTERN", "Tokenizer", "__version__", "bytes_to_unicode", "encode_file", "train_bpe"]

_HOMES = {
    "GPT2_PATTERN": "tlm_tokenizer.pretokenize",
    "Tokenizer": "tlm_tokenizer.tokenizer",
    "bytes_to_unicode": "tlm_tokenizer.gpt2_format",
    "encode_file": "tlm_tokenizer._encode_file",
    "train_bpe": "tlm_tokenizer.train",
}

if TYPE_CHECKING:
    from tlm_tokenizer._encode_file import encode_file
    from tlm_tokenizer.gpt2_format import bytes_to_unicode
    from tlm_tokenizer.pretokenize import GPT2_PATTERN
    from tlm_tokenizer.tokenizer import Tokenizer
    from tlm_tokenizer.train import train_bpe


lazy_exports(__name__, _HOMES)

"""What the Scheduler's server-free tests build a scheduler from: a tiny seeded model over 257 ids and a byte-level
tokenizer (ids 0-255 are the bytes, 256 the end of text), so no tokenizer is trained."""

import torch


def byte_model():
    from tlm_model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=257, context_length=64, d_model=16, num_layers=1, num_heads=2,
                                     d_ff=32)).eval()  # fmt: skip


def byte_tokenizer():
    from tlm_tokenizer import Tokenizer

    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])

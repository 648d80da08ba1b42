"""Two small, different tokenizers for tests that save and load in several processes (light to import)."""

from tlm_tokenizer import Tokenizer

BYTES = {i: bytes([i]) for i in range(256)}


def make(kind: str) -> Tokenizer:
    """A has <|endoftext|> (so its tokenizer_config.json names an eos_token), B has not."""
    if kind == "A":
        return Tokenizer(BYTES | {256: b"ab", 257: b"abc"}, [(b"a", b"b"), (b"ab", b"c")], ["<|endoftext|>"])
    return Tokenizer(BYTES | {256: b"xy"}, [(b"x", b"y")], ["<|eot|>"])


def which(tokenizer: Tokenizer) -> str:
    """ "A" or "B": the one ``tokenizer`` equals in vocab, merges and special tokens."""
    for kind in "AB":
        reference = make(kind)
        if (tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens) == (
            reference.vocab,
            reference.merges,
            reference.special_tokens,
        ):
            return kind
    raise AssertionError(f"neither A nor B: {tokenizer.special_tokens}, {tokenizer.merges}")

"""Independent references the tests compare against (none of them calls tlm-tokenizer's encoder)."""

from itertools import pairwise

import pytest

from tlm_tokenizer import GPT2_PATTERN


def naive_bpe(token: bytes, ranks: dict[tuple[bytes, bytes], int]) -> list[bytes]:
    """The textbook rule on byte strings: merge the adjacent pair of lowest rank (the leftmost of
    equal ones), then look again, until no adjacent pair has a rank."""
    parts = [bytes([byte]) for byte in token]
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(pairwise(parts)) if pair in ranks]
        if not ranked:
            break
        _, i = min(ranked)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_from(tokenizer):
    """A tiktoken Encoding built from a tokenizer's merges: ranks = our ids, GPT-2's pattern, same specials.

    Right for vocabularies whose ids follow the merge order (train_bpe's, GPT-2's): tiktoken ranks a
    token by its id.
    """
    tiktoken = pytest.importorskip("tiktoken")
    specials = {token: tokenizer.encode(token)[0] for token in tokenizer.special_tokens}
    special_ids = set(specials.values())
    ranks = {token: index for index, token in tokenizer.vocab.items() if index not in special_ids}
    return tiktoken.Encoding(name="ours", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)

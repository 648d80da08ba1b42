"""bpe.merge (the scan for words, the heap for long pre-tokens) against the textbook rule and tiktoken."""

import hashlib
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import same_code_env
from references import naive_bpe

from tlm_tokenizer import bpe


def table_of(merges: list[tuple[bytes, bytes]]) -> tuple[dict[tuple[int, int], int], dict[bytes, int]]:
    """A merge table over ids 0-255 for the bytes and 256 + rank for each merge's result."""
    ids = {bytes([byte]): byte for byte in range(256)}
    for left, right in merges:
        ids.setdefault(left + right, len(ids))
    table = {}
    for rank, (left, right) in enumerate(merges):
        table.setdefault((ids[left], ids[right]), bpe.pack(rank, ids[left + right]))
    return table, ids


def random_merges(rng: random.Random, alphabet: bytes, count: int) -> list[tuple[bytes, bytes]]:
    """Merges of random known tokens, in random order: ranks need not follow the order tokens are made
    in (a merge may use a token that a later merge makes), which neither algorithm may assume."""
    tokens = [bytes([byte]) for byte in alphabet]
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < count:
        pair = (rng.choice(tokens), rng.choice(tokens))
        if pair not in merges:
            merges.append(pair)
            tokens.append(pair[0] + pair[1])
    rng.shuffle(merges)
    return merges


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    length=st.integers(0, 2 * bpe.HEAP_MIN),
    alphabet=st.sampled_from([b"ab", b"abc", b"a", b"abcd"]),
)
def test_scan_and_heap_follow_the_textbook_rule(seed, length, alphabet):
    rng = random.Random(seed)
    merges = random_merges(rng, alphabet, rng.randint(1, 40))
    table, ids = table_of(merges)
    token = bytes(rng.choice(alphabet) for _ in range(length))
    expected = [ids[part] for part in naive_bpe(token, {pair: rank for rank, pair in enumerate(merges)})]
    assert bpe.merge_scan(list(token), table) == expected
    assert bpe.merge_heap(list(token), table) == expected
    assert bpe.merge(list(token), table) == expected


def test_ties_go_to_the_leftmost_pair():
    table, ids = table_of([(b"a", b"a"), (b"aa", b"a")])
    for merge in (bpe.merge_scan, bpe.merge_heap):
        # "aaa": (a, a) at 0 and at 1 tie; the left one merges, and (aa, a) follows: one token.
        assert merge(list(b"aaa"), table) == [ids[b"aaa"]]
        # "aaaa": after the first merge, (a, a) at 1 outranks (aa, a) at 0.
        assert merge(list(b"aaaa"), table) == [ids[b"aa"], ids[b"aa"]]
        assert merge(list(b""), table) == [] and merge(list(b"a"), table) == [ids[b"a"]]


def test_merge_takes_the_heap_from_heap_min_on(monkeypatch):
    calls = []
    monkeypatch.setattr(bpe, "merge_heap", lambda parts, table: calls.append(len(parts)) or parts)
    bpe.merge([1] * (bpe.HEAP_MIN - 1), {})
    bpe.merge([1] * bpe.HEAP_MIN, {})
    assert calls == [bpe.HEAP_MIN]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    length=st.integers(0, 300),
    alphabet=st.sampled_from([b"ab", b"abc", b"a", b"abcd"]),
)
def test_rank_order_follows_the_textbook_rule_where_ranks_follow_creation(seed, length, alphabet):
    from tlm_tokenizer._rank_order import RankOrderMerge

    rng = random.Random(seed)
    tokens = [bytes([byte]) for byte in alphabet]
    merges: list[tuple[bytes, bytes]] = []
    for _ in range(rng.randint(1, 40)):  # each merge makes a new token from ones made before: creation order
        pair = (rng.choice(tokens), rng.choice(tokens))
        if pair[0] + pair[1] not in tokens:
            merges.append(pair)
            tokens.append(pair[0] + pair[1])
    table, ids = table_of(merges)
    token = bytes(rng.choice(alphabet) for _ in range(length))
    expected = [ids[part] for part in naive_bpe(token, {pair: rank for rank, pair in enumerate(merges)})]
    merge = RankOrderMerge.build(table)
    assert merge is not None and merge(list(token)) == expected


def test_rank_order_refuses_a_table_whose_merge_uses_a_later_token_and_encode_takes_the_heap(monkeypatch):
    from tlm_tokenizer import Tokenizer
    from tlm_tokenizer._rank_order import RankOrderMerge

    # (aa, a) at rank 0 uses "aa", which rank 1 makes: "aaa" merges (a, a) then (aa, a), lower rank second.
    merges = [(b"aa", b"a"), (b"a", b"a")]
    table, ids = table_of(merges)
    assert RankOrderMerge.build(table) is None
    tokenizer = Tokenizer({i: token for token, i in ids.items()}, merges)
    calls = []
    monkeypatch.setattr(bpe, "merge", lambda parts, table: calls.append(len(parts)) or bpe.merge_heap(parts, table))
    text = "a" * (3 * 30_000 + 2)
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    assert naive_bpe(b"a" * 11, ranks) == [b"aaa"] * 3 + [b"aa"]  # the pattern, in small
    assert tokenizer.encode(text) == [ids[b"aaa"]] * 30_000 + [ids[b"aa"]] and calls == [len(text)]


def test_encode_takes_rank_order_steps_from_rank_order_min_on(gpt2_tokenizer, monkeypatch):
    from tlm_tokenizer._rank_order import RankOrderMerge

    calls = []
    real = RankOrderMerge.__call__
    monkeypatch.setattr(RankOrderMerge, "__call__", lambda self, parts: calls.append(len(parts)) or real(self, parts))
    gpt2_tokenizer.encode("x" * (bpe.RANK_ORDER_MIN - 1))
    gpt2_tokenizer.encode("y" * bpe.RANK_ORDER_MIN)
    assert calls == [bpe.RANK_ORDER_MIN]


def long_pretokens(rng: random.Random, length: int) -> list[str]:
    """Strings that GPT-2's pattern keeps whole: runs of letters, of digits, of punctuation, one letter."""
    return [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(length)),
        "".join(rng.choice("0123456789") for _ in range(length)),
        "".join(rng.choice("-=_.,;:!?/()[]{}<>*#") for _ in range(length)),
        "a" * length,
        "".join(rng.choice("éàüßøåæçñ") for _ in range(length // 2)),
    ]


@pytest.mark.parametrize("length", [bpe.HEAP_MIN - 1, bpe.HEAP_MIN, 1_000, 20_000, bpe.RANK_ORDER_MIN])
def test_long_pretokens_match_tiktoken(gpt2_tokenizer, tiktoken_gpt2, length):
    for text in long_pretokens(random.Random(length), length):
        assert gpt2_tokenizer.encode(text) == tiktoken_gpt2.encode_ordinary(text)


SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    from tlm_tokenizer import Tokenizer
    tokenizer = Tokenizer.from_files(sys.argv[1], sys.argv[2])
    ids = tokenizer.encode(sys.stdin.read())
    print(len(ids), hashlib.sha256(repr(ids).encode()).hexdigest())
    """
)


def test_a_pretoken_of_300_000_letters_encodes_like_tiktoken_in_a_subprocess(gpt2_files, tiktoken_gpt2):
    # The scan alone (O(n^2): 0.5 s at 8,000 letters, 6.9 s at 32,000) would need about ten minutes here,
    # the heap about a second. The timeout is generous for a loaded machine; only a quadratic algorithm
    # comes near it.
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(300_000))
    expected = tiktoken_gpt2.encode_ordinary(text)
    args = [sys.executable, "-c", SCRIPT, str(gpt2_files["encoder.json"]), str(gpt2_files["vocab.bpe"])]
    try:
        done = subprocess.run(
            args, input=text, capture_output=True, text=True, timeout=300, check=False, env=same_code_env()
        )
    except subprocess.TimeoutExpired:
        pytest.fail("encoding one pre-token of 300,000 letters took over 300 s: BPE is not O(n log n)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(len(expected)), hashlib.sha256(repr(expected).encode()).hexdigest()]

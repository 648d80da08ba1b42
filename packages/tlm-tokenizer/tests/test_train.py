"""train_bpe against a deliberately naive trainer that recounts every pair after every merge."""

import re
from collections import Counter

import pytest
import regex
from bpe_strategies import SPECIALS, texts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spies import record_bars_and_pools

from tlm_tokenizer import train as train_module
from tlm_tokenizer import train_bpe

# Written out again here from the course handout rather than imported from the package.
PATTERN = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def naive_pretoken_counts(text: str, special_tokens: list[str]) -> Counter[bytes]:
    segments = [text]
    if special_tokens:
        alternation = "|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True))
        segments = re.split(alternation, text)
    return Counter(token.encode("utf-8") for segment in segments for token in PATTERN.findall(segment))


def naive_train(text: str, vocab_size: int, special_tokens: list[str]):
    """The textbook algorithm: count all pairs from scratch, merge the best, repeat."""
    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    words = {tuple(bytes([b]) for b in token): n for token, n in naive_pretoken_counts(text, special_tokens).items()}
    merges = []
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, n in words.items():
            for i in range(len(word) - 1):
                pairs[word[i], word[i + 1]] += n
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        new_words = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + n
        words = new_words
    return vocab, merges


def write(tmp_path, text: str, name: str = "input.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def test_matches_naive_trainer_on_english(tmp_path, english_text):
    text = english_text[:40_000]
    path = write(tmp_path, text)
    vocab, merges = train_bpe(path, 500, ["<|endoftext|>"], num_workers=1)
    ref_vocab, ref_merges = naive_train(text, 500, ["<|endoftext|>"])
    assert merges == ref_merges
    assert vocab == ref_vocab
    assert len(vocab) == 500


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts(max_size=80), extra=st.integers(0, 60), use_specials=st.booleans())
def test_matches_naive_trainer_on_tie_heavy_text(tmp_path, text, extra, use_specials):
    specials = SPECIALS if use_specials else []
    path = write(tmp_path, text)
    vocab_size = 256 + len(specials) + extra
    assert train_bpe(path, vocab_size, specials, num_workers=1) == naive_train(text, vocab_size, specials)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(st.text(alphabet="aab", min_size=1, max_size=14), min_size=1, max_size=30),
    extra=st.integers(1, 40),
)
def test_matches_naive_trainer_on_runs_of_one_symbol(tmp_path, words, extra):
    # Pairs like (a, a) overlap themselves: "aaa" holds two but merges once, and a word may hold the
    # pair's left symbol many times without the pair. The merge loop walks occurrences by count.
    text = " ".join(words)
    path = write(tmp_path, text)
    assert train_bpe(path, 256 + extra, [], num_workers=1) == naive_train(text, 256 + extra, [])


def test_parallel_ranges_count_like_one_pass(tmp_path, english_text, monkeypatch):
    # Tiny ranges force many cuts (inside lines, next to special tokens) and two worker processes.
    monkeypatch.setattr(train_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(train_module, "_RANGE_BYTES", 4_000)
    text = "<|endoftext|>".join(english_text[i : i + 9_000] for i in range(0, 90_000, 9_000)) + "  \r\n"
    path = write(tmp_path, text)
    counts = train_module.count_file(path, ["<|endoftext|>"], num_workers=2)
    expected = naive_pretoken_counts(text, ["<|endoftext|>"])
    assert {token.encode("utf-8"): n for token, n in counts.items()} == dict(expected)
    assert train_bpe(path, 400, ["<|endoftext|>"], num_workers=2) == naive_train(text, 400, ["<|endoftext|>"])


def test_progress_bars_show_for_large_runs_only(tmp_path, monkeypatch):
    record = record_bars_and_pools(monkeypatch, train_module)
    path = write(tmp_path, "low lower lowest " * 50)
    size = path.stat().st_size
    _, merges = train_bpe(path, 300, [], num_workers=1)  # small: no bar even on a terminal
    _, many = train_bpe(path, 256 + 2_000, [], num_workers=1)  # 2,000 merges wanted: a bar on a terminal
    train_bpe(path, 300, [], num_workers=1, progress=True)
    monkeypatch.setattr(train_module, "_PROGRESS_MIN_BYTES", size)
    train_bpe(path, 300, [], num_workers=1)
    count, merge, count_many, merge_many, count_forced, merge_forced, count_large, _ = record["bars"]
    assert count.kwargs == {"total": size, "unit": "B", "unit_scale": True, "desc": "pre-tokenising"}
    assert count.n == size and merge.kwargs == {"total": 44, "desc": "merging"} and merge.n == len(merges) == 7
    assert merge_many.kwargs["total"] == 2_000 and merge_many.n == len(many) < 2_000  # stopped: no pair left
    assert [bar.enabled for bar in (count, merge, count_many, merge_many)] == [False, False, False, None]
    assert [count_forced.enabled, merge_forced.enabled, count_large.enabled] == [True, True, None]


def test_large_files_are_counted_in_worker_processes(tmp_path, monkeypatch):
    record = record_bars_and_pools(monkeypatch, train_module)
    monkeypatch.setattr(train_module, "_PARALLEL_MIN_BYTES", 1_000)
    monkeypatch.setattr(train_module, "_RANGE_BYTES", 500)
    big, small = write(tmp_path, "word " * 600, "big.txt"), write(tmp_path, "word " * 100, "small.txt")
    expected = {"word": 1, " word": 599, " ": 1}
    assert train_module.count_file(big, [], num_workers=4) == expected  # 6 ranges of at most 500 bytes
    # Below 1,000 bytes: one process, whatever num_workers says.
    assert train_module.count_file(small, [], num_workers=4) == {"word": 1, " word": 99, " ": 1}
    assert train_module.count_file(big, [], num_workers=1) == expected
    assert record["pools"] == [(4, "fork")]


def test_semantics(tmp_path):
    text = "low lower lowest<|endoftext|>newer newest<|endoftext|>widest " * 5
    vocab, merges = train_bpe(write(tmp_path, text), 256 + 1 + 12, ["<|endoftext|>"])
    assert len(vocab) == 269 and len(merges) == 12
    assert b"<|endoftext|>" in vocab.values()
    assert all(b"<|" not in a + b for a, b in merges), "a merge crossed a special token"
    assert sorted(vocab) == list(range(269))


def test_reads_without_newline_translation(tmp_path):
    # "\r\n\r" is one pre-token here; with universal newlines there would be no b"\r" at all.
    _, merges = train_bpe(write(tmp_path, "x\r\n\r\ny" * 10), 257, [])
    assert merges == [(b"\r", b"\n")]


def test_stops_when_no_pair_is_left(tmp_path):
    vocab, merges = train_bpe(write(tmp_path, "ab ab"), 1000, [])
    assert merges == [(b"a", b"b"), (b" ", b"ab")]
    assert len(vocab) == 258


def test_empty_file(tmp_path):
    assert train_bpe(write(tmp_path, ""), 300, ["<|endoftext|>"]) == (
        {**{i: bytes([i]) for i in range(256)}, 256: b"<|endoftext|>"},
        [],
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"vocab_size": 100}, ValueError, "vocab_size must be at least 257 .256 bytes . 1 special tokens., got 100"),
        ({"vocab_size": 300.0}, TypeError, "vocab_size must be an int, got float"),
        ({"special_tokens": "<|endoftext|>"}, TypeError, "special_tokens must be a list of str, got str"),
        ({"special_tokens": [""]}, TypeError, "special_tokens must hold non-empty str, got ''"),
        ({"input_path": 3}, TypeError, "input_path must be a str or os.PathLike, got int"),
        ({"num_workers": 0}, ValueError, "num_workers must be positive, got 0"),
        ({"num_workers": 2.0}, TypeError, "num_workers must be an int, got float"),
        ({"vocab_size": True}, TypeError, "vocab_size must be an int, got bool"),
        ({"special_tokens": [1]}, TypeError, "special_tokens must hold non-empty str, got 1"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    arguments = {"input_path": write(tmp_path, "hello"), "vocab_size": 300, "special_tokens": ["<|endoftext|>"]}
    with pytest.raises(error, match=match):
        train_bpe(**{**arguments, **kwargs})


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        train_bpe(tmp_path / "absent.txt", 300, [])

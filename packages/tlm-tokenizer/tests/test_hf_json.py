"""tokenizer.json (HF tokenizers' format): HF tokenizers and transformers encode and decode the files we
write exactly as we do; we read the files HF writes; we refuse, in one line naming the file, what we
cannot reproduce and what is malformed."""

import copy
import json

import pytest
from bpe_strategies import SPECIALS, hf_texts
from hypothesis import given, settings
from hypothesis import strategies as st

from tlm_tokenizer import Tokenizer, bytes_to_unicode, train_bpe
from tlm_tokenizer import hf_json as module

tokenizers = pytest.importorskip("tokenizers")

# Overlapping special tokens: HF matches added tokens leftmost-longest, as we do.
OUR_SPECIALS = ["<|endoftext|>", *SPECIALS]
SAMPLES = [
    "Héllò wörld! 日本語のテキスト 🤖🚀 — naïve café\r\n\ttabs  and   spaces\u00a0nbsp\u3000ideographic\n",
    "numbers 3.14159, 1,000,000; contractions: I'm, you'll, they've, we'd, it's, she's. ¿Qué? Ωμέγα",
    "\n\n\n   trailing   ",
    "    \t\t  \n \r\n\r\n   x  ",
    "<|endoftext|><|endoftext|>a<|eot|><|eot|><|eot|> <|eot|><|eot|><|eot|><|eot|>b<|eot|",
    "👨\u200d👩\u200d👧 \U0001f1fa\U0001f1f8 e\u0301 ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x01\x7f",
    "",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, english_text):
    path = tmp_path_factory.mktemp("train") / "corpus.txt"
    path.write_bytes("<|endoftext|>".join([english_text[:100_000], english_text[100_000:200_000]]).encode())
    vocab, merges = train_bpe(path, 1_500, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, OUR_SPECIALS)


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer):
    return Tokenizer(gpt2_tokenizer.vocab, gpt2_tokenizer.merges, OUR_SPECIALS)


def save_and_read_with_hf(ours: Tokenizer, folder):
    """(our tokenizer, its saved folder, HF tokenizers' Tokenizer read from its tokenizer.json)."""
    ours.save(folder)
    return ours, folder, tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def saved_trained(trained, tmp_path_factory):
    return save_and_read_with_hf(trained, tmp_path_factory.mktemp("trained") / "tok")


@pytest.fixture(scope="module")
def saved_gpt2(gpt2, tmp_path_factory):
    return save_and_read_with_hf(gpt2, tmp_path_factory.mktemp("gpt2") / "tok")


@pytest.fixture(scope="module", params=["trained", "gpt2"])
def saved(request):
    return request.getfixturevalue(f"saved_{request.param}")


@pytest.fixture(scope="module")
def auto(saved):
    transformers = pytest.importorskip("transformers")
    ours, folder, _ = saved
    return ours, transformers.AutoTokenizer.from_pretrained(folder)


def with_specials(draw_text: str, positions: list[int]) -> str:
    for position in sorted(positions, reverse=True):
        at = position % (len(draw_text) + 1)
        draw_text = draw_text[:at] + OUR_SPECIALS[position % len(OUR_SPECIALS)] + draw_text[at:]
    return draw_text


# -- what HF makes of the files we write ----------------------------------------------------------


def test_hf_tokenizers_match_us_on_samples_and_english(saved, english_text):
    ours, _, hf = saved
    for text in [*SAMPLES, english_text[200_000:260_000]]:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == ids
        assert hf.decode(ids, skip_special_tokens=False) == ours.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=hf_texts(max_size=40), positions=st.lists(st.integers(0, 10_000), max_size=4))
def test_hf_tokenizers_match_us_on_generated_text(saved, text, positions):
    ours, _, hf = saved
    text = with_specials(text, positions)
    ids = ours.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids
    assert hf.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=60, deadline=None)
@given(text=hf_texts(max_size=40), positions=st.lists(st.integers(0, 10_000), max_size=3))
def test_autotokenizer_matches_us_on_generated_text(auto, text, positions):
    ours, auto_tokenizer = auto
    text = with_specials(text, positions)
    ids = auto_tokenizer(text)["input_ids"]  # as users call it: the default add_special_tokens=True adds nothing
    assert ids == ours.encode(text)
    assert auto_tokenizer.decode(ids) == text


def test_autotokenizer_matches_us_on_samples_and_knows_the_end_of_text(auto, english_text):
    ours, auto_tokenizer = auto
    for text in [*SAMPLES, english_text[300_000:330_000]]:
        assert auto_tokenizer(text)["input_ids"] == ours.encode(text)
        assert auto_tokenizer.decode(ours.encode(text)) == text
    assert auto_tokenizer.eos_token == "<|endoftext|>"
    assert auto_tokenizer.eos_token_id == ours.encode("<|endoftext|>")[0]
    assert len(auto_tokenizer) == len(ours)


def test_special_tokens_with_spaces_and_non_ascii_keep_their_ids_in_hf(tmp_path):
    # model.vocab holds a special token under its own text: HF takes an added token's id from there,
    # and would number one it cannot find from the end of the vocab, whatever added_tokens says.
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|é|>", "<|a b|>", "<|x|>"])
    tokenizer.save(tmp_path / "tok")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    text = "a<|é|>b<|a b|><|x|>"
    ids = tokenizer.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids == [97, 256, 98, 257, 258]
    assert Tokenizer.load(tmp_path / "tok").vocab == tokenizer.vocab
    # HF runs an added token's text through the ByteLevel decoder, which reads "é" as the byte 0xE9: a
    # known HF behaviour in decoding only. We decode what we encoded.
    assert tokenizer.decode(ids) == text and hf.decode(ids, skip_special_tokens=False) == "a<|\ufffd|>b<|a b|><|x|>"


def test_a_special_token_spelled_like_another_tokens_bytes_cannot_be_written():
    # "Ġ" is how tokenizer.json writes the byte b" "; a special token "Ġ" would need the same key.
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["Ġ"])
    with pytest.raises(
        ValueError, match="special_tokens: 'Ġ' is also the byte-level text of another token .ids 32 and 256."
    ):
        tokenizer.hf_files()


def test_from_hf_reads_special_tokens_hf_added_after_its_vocab(tmp_path):
    # HF's add_special_tokens numbers new tokens from the end of model.vocab and leaves model.vocab alone.
    vocab = {text: byte for byte, text in bytes_to_unicode().items()} | {"ab": 256}
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", "b")]))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens(["<|é|>", "<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    assert ours.special_tokens == ["<|é|>", "<|endoftext|>"]
    text = "ab<|é|>ab<|endoftext|>b a"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids == [256, 257, 256, 258, 98, 32, 97]
    document = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    document["added_tokens"][0]["id"] = 300  # HF ignores it and numbers the token 257 anyway
    (tmp_path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError, match="added token '<|é|>' has id 300, but HF tokenizers gives it 257"):
        Tokenizer.from_hf(tmp_path / "tokenizer.json")


def test_gpt2_round_trips_through_tokenizer_json_with_tiktokens_ids(saved_gpt2, tiktoken_gpt2, english_text):
    ours, folder, hf = saved_gpt2  # GPT-2's own files, read by from_files, plus our special tokens
    loaded = Tokenizer.load(folder)
    assert loaded.vocab == ours.vocab and loaded.merges == ours.merges
    assert loaded.special_tokens == OUR_SPECIALS
    for text in [english_text[:100_000], *(sample for sample in SAMPLES if "<|eot" not in sample)]:
        expected = tiktoken_gpt2.encode(text, allowed_special="all")  # tiktoken knows <|endoftext|> only
        assert loaded.encode(text) == expected
        assert hf.encode(text, add_special_tokens=False).ids == expected


def test_the_files_we_write(trained, tmp_path):
    files = trained.hf_files()
    trained.save(tmp_path / "tok")
    assert sorted([*files, "tlm_sha256.json"]) == sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert all((tmp_path / "tok" / name).read_bytes() == data for name, data in files.items())
    document = json.loads(files["tokenizer.json"])
    assert document["model"]["type"] == "BPE" and document["normalizer"] is None
    assert document["pre_tokenizer"] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    assert document["model"]["vocab"]["Ġ"] == 32 and document["model"]["vocab"]["!"] == 33  # GPT-2's byte table
    assert document["model"]["merges"][0] == "{} {}".format(*(t.decode().replace(" ", "Ġ") for t in trained.merges[0]))
    assert [(t["content"], t["special"], t["normalized"]) for t in document["added_tokens"]] == [
        (token, True, False) for token in OUR_SPECIALS
    ]
    config = json.loads(files["tokenizer_config.json"])
    assert config == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
    }
    no_eos = json.loads(Tokenizer(trained.vocab, trained.merges, ["<|eot|>"]).hf_files()["tokenizer_config.json"])
    assert "eos_token" not in no_eos


# -- what we make of files HF writes --------------------------------------------------------------


def test_from_hf_reads_what_hf_tokenizers_saves(saved_trained, tmp_path):
    ours, _, hf = saved_trained
    hf.save(str(tmp_path / "tokenizer.json"))  # HF's own serializer: [left, right] merges, every field
    loaded = Tokenizer.from_hf(tmp_path / "tokenizer.json")  # the file (the folder: test below)
    assert loaded.vocab == ours.vocab and loaded.merges == ours.merges
    assert loaded.special_tokens == ours.special_tokens


def test_from_hf_and_load_read_what_transformers_saves(saved_trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours, folder, _ = saved_trained
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path)
    for read in (Tokenizer.from_hf, Tokenizer.load):
        loaded = read(tmp_path)
        assert loaded.vocab == ours.vocab and loaded.merges == ours.merges
        assert loaded.special_tokens == ours.special_tokens


def small() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b" ab"}
    return Tokenizer(vocab, [(b"a", b"b"), (b" ", b"ab")], ["<|endoftext|>"])


def document_of(tokenizer: Tokenizer) -> dict:
    return json.loads(tokenizer.hf_files()["tokenizer.json"])


def gpt2_hub_layout(document: dict) -> dict:
    """The layout of the tokenizer.json on HF's hub for GPT-2 (written by an older HF tokenizers)."""
    document = copy.deepcopy(document)
    model = document["model"]
    del model["type"], model["byte_fallback"]
    model["continuing_subword_prefix"] = model["end_of_word_suffix"] = ""
    for component in ("pre_tokenizer", "post_processor", "decoder"):
        del document[component]["use_regex"]
    for token in document["added_tokens"]:
        token["normalized"] = True
    return document


def split_then_byte_level(document: dict, pattern: str) -> dict:
    """GPT-2's pre-tokenization written as a Split on a pattern, then ByteLevel without its own regex
    (the layout of Llama 3's file, whose pattern differs)."""
    document = copy.deepcopy(document)
    document["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    return document


HF_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (  # the pattern in Llama 3's tokenizer.json
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("layout", ["gpt2-hub", "split-then-byte-level", "list-merges"])
def test_from_hf_reads_other_spellings_of_the_same_tokenizer(tmp_path, layout):
    tokenizer = small()
    document = document_of(tokenizer)
    if layout == "gpt2-hub":
        document = gpt2_hub_layout(document)
    elif layout == "split-then-byte-level":
        document = split_then_byte_level(document, HF_GPT2_PATTERN)
    else:
        document["model"]["merges"] = [merge.split(" ") for merge in document["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    loaded = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    assert loaded.vocab == tokenizer.vocab and loaded.merges == tokenizer.merges
    assert loaded.special_tokens == tokenizer.special_tokens
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "ab ab  abab's<|endoftext|> b a"
    assert hf.encode(text, add_special_tokens=False).ids == loaded.encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("dropout", [None, 0, 0.0])
def test_from_hf_reads_a_dropout_of_zero_as_no_dropout(tmp_path, dropout):
    # JSON's 0.0 parses to a new float object, so only an equality check (not identity) accepts it.
    tokenizer = small()
    document = document_of(tokenizer)
    document["model"]["dropout"] = dropout
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    loaded = Tokenizer.from_hf(path)
    assert loaded.vocab == tokenizer.vocab and loaded.merges == tokenizer.merges
    hf = tokenizers.Tokenizer.from_file(str(path))
    text = "ab ab  abab's<|endoftext|> b a"
    assert hf.encode(text, add_special_tokens=False).ids == loaded.encode(text)


def _set(path: str, value: object):
    def change(document: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            document = document[int(key)] if isinstance(document, list) else document[key]
        if value is KeyError:
            del document[last]
        elif isinstance(document, list):
            document[int(last)] = value
        else:
            document[last] = value

    return change


def _split_with(path: str, value: object):
    """The GPT-2 Split-then-ByteLevel layout with one of its pre-tokenizers' fields changed."""

    def change(document: dict) -> None:
        document.update(split_then_byte_level(document, HF_GPT2_PATTERN))
        _set(path, value)(document)

    return change


DIFFERENT = [
    (
        "llama3-pattern",
        lambda d: d.update(split_then_byte_level(d, LLAMA3_PATTERN)),
        "expected GPT-2's pre-tokenization pattern, got \"(?i:'s",
    ),
    ("normalizer", _set("normalizer", {"type": "NFC"}), "expected no normalizer, got a 'NFC' one"),
    ("truncation", _set("truncation", {"max_length": 8}), "expected no truncation, got {'max_length': 8}"),
    ("padding", _set("padding", {"pad_id": 0}), "expected no padding, got {'pad_id': 0}"),
    (
        "prefix-space",
        _set("pre_tokenizer.add_prefix_space", True),
        "expected add_prefix_space false in the pre-tokenizer, got true",
    ),
    (
        "no-regex",
        _set("pre_tokenizer.use_regex", False),
        "expected the ByteLevel pre-tokenizer to split with GPT-2's pattern, got use_regex false",
    ),
    (
        "metaspace",
        _set("pre_tokenizer", {"type": "Metaspace"}),
        "expected a ByteLevel pre-tokenizer with GPT-2's pattern, got a 'Metaspace' one",
    ),
    (
        "no-pre-tokenizer",
        _set("pre_tokenizer", None),
        "expected a ByteLevel pre-tokenizer with GPT-2's pattern, got null",
    ),
    (
        "split-removed",
        _split_with("pre_tokenizer.pretokenizers.0.behavior", "Removed"),
        "expected the Split pre-tokenizer to isolate its matches",
    ),
    (
        "split-inverted",
        _split_with("pre_tokenizer.pretokenizers.0.invert", True),
        "expected the Split pre-tokenizer to isolate its matches",
    ),
    (
        "split-and-regex",
        _split_with("pre_tokenizer.pretokenizers.1.use_regex", True),
        "expected ByteLevel after Split to have use_regex false, got true",
    ),
    (
        "split-prefix-space",
        _split_with("pre_tokenizer.pretokenizers.1.add_prefix_space", True),
        "expected add_prefix_space false in the pre-tokenizer",
    ),
    ("decoder", _set("decoder", {"type": "WordPiece"}), "expected a ByteLevel decoder, got a 'WordPiece' one"),
    ("no-decoder", _set("decoder", None), "expected a ByteLevel decoder, got null"),
    (
        "post-processor",
        _set("post_processor", {"type": "TemplateProcessing"}),
        "expected no post_processor or a ByteLevel one, got a 'TemplateProcessing' one",
    ),
    ("wordpiece", _set("model.type", "WordPiece"), "expected a BPE model, got 'WordPiece'"),
    ("dropout", _set("model.dropout", 0.1), "expected model.dropout null or 0 or 0.0, got 0.1"),
    ("dropout-false", _set("model.dropout", False), "expected model.dropout null or 0 or 0.0, got False"),
    ("unk", _set("model.unk_token", "<unk>"), "expected model.unk_token null, got '<unk>'"),
    (
        "prefix",
        _set("model.continuing_subword_prefix", "##"),
        "expected model.continuing_subword_prefix null or \"\", got '##'",
    ),
    ("suffix", _set("model.end_of_word_suffix", "</w>"), "expected model.end_of_word_suffix null or \"\", got '</w>'"),
    ("byte-fallback", _set("model.byte_fallback", True), "expected model.byte_fallback null or false, got True"),
    ("ignore-merges", _set("model.ignore_merges", True), "expected model.ignore_merges null or false, got True"),
    (
        "lstrip",
        _set("added_tokens.0.lstrip", True),
        "expected added token '<|endoftext|>' without lstrip, got lstrip true",
    ),
    ("rstrip", _set("added_tokens.0.rstrip", True), "without rstrip, got rstrip true"),
    ("single-word", _set("added_tokens.0.single_word", True), "without single_word, got single_word true"),
    (
        "mixed-normalized",
        lambda d: d["added_tokens"].append({**d["added_tokens"][0], "id": 300, "content": "<|x|>", "normalized": True}),
        "expected added tokens all normalized or all not, got both",
    ),
    (
        "added-id-not-models",
        _set("added_tokens.0.id", 38),
        "added token '<|endoftext|>' has id 38, but model.vocab gives it 258",
    ),
]


@pytest.mark.parametrize(("change", "message"), [case[1:] for case in DIFFERENT], ids=[case[0] for case in DIFFERENT])
def test_from_hf_refuses_what_tlm_would_encode_differently(tmp_path, change, message):
    document = document_of(small())
    change(document)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError) as raised:
        Tokenizer.from_hf(path)
    assert str(raised.value).startswith(f"{path}: ") and message in str(raised.value)
    assert "\n" not in str(raised.value)


def _vocab_entry(text: str, index: object):
    return lambda d: d["model"]["vocab"].update({text: index})


MALFORMED = [
    ("not-json", b"this is not JSON", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("not-utf8", b'{"model": "\xff"}', "expected UTF-8 JSON, got byte 0xff at 11"),
    ("array", b"[]", "expected a JSON object, got list"),
    ("no-model", _set("model", KeyError), "expected a key model, got none"),
    ("model-array", _set("model", []), "expected model to be a JSON object, got JSON array"),
    ("no-vocab", _set("model.vocab", KeyError), "expected a key model.vocab, got none"),
    ("vocab-array", _set("model.vocab", []), "expected model.vocab to be a JSON object, got JSON array"),
    ("string-id", _vocab_entry("Ġx", "3"), "expected int ids in model.vocab, got '3' for 'Ġx'"),
    ("bool-id", _vocab_entry("Ġx", True), "expected int ids in model.vocab, got True for 'Ġx'"),
    ("float-id", _vocab_entry("Ġx", 3.0), "expected int ids in model.vocab, got 3.0 for 'Ġx'"),
    ("duplicate-id", _vocab_entry("Ġx", 97), "expected distinct ids in model.vocab, got 97 twice"),
    ("negative-id", _vocab_entry("Ġx", -1), "vocab ids must lie in [0, 2**32), got -1"),
    ("huge-id", _vocab_entry("Ġx", 2**32), "vocab ids must lie in [0, 2**32), got 4294967296"),
    ("raw-space", _vocab_entry("a b", 400), "expected GPT-2 byte-level characters, got ' ' in 'a b'"),
    ("not-byte-level", _vocab_entry("€", 400), "expected GPT-2 byte-level characters, got '€' in '€'"),
    (
        "byte-missing",
        lambda d: d["model"]["vocab"].pop("A"),
        "vocab must hold all 256 single bytes, got none for byte 65",
    ),
    ("merges-object", _set("model.merges", {}), "expected model.merges to be a JSON array, got JSON object"),
    ("no-merges", _set("model.merges", KeyError), "expected a key model.merges, got none"),
    (
        "merge-of-three",
        lambda d: d["model"]["merges"].append("a b c"),
        "expected each merge as 'left right' or [left, right], got 'a b c' at 2",
    ),
    (
        "merge-of-ints",
        lambda d: d["model"]["merges"].append([1, 2]),
        "expected each merge as 'left right' or [left, right], got [1, 2] at 2",
    ),
    ("merge-number", lambda d: d["model"]["merges"].append(7), "got 7 at 2"),
    (
        "merge-not-in-vocab",
        lambda d: d["model"]["merges"].append("x q"),
        "merges[2] (b'x', b'q') needs b'xq', which vocab lacks",
    ),
    (
        "merge-repeated",
        lambda d: d["model"]["merges"].append("a b"),
        "merges must hold each pair once, got (b'a', b'b') at ranks 0 and 2",
    ),
    (
        "merge-not-byte-level",
        lambda d: d["model"]["merges"].append("a €"),
        "expected GPT-2 byte-level characters, got '€' in '€'",
    ),
    ("added-not-list", _set("added_tokens", {}), "expected added_tokens to be a list, got dict"),
    (
        "added-not-object",
        _set("added_tokens.0", "<|endoftext|>"),
        "expected each added token to be an object, got '<|endoftext|>'",
    ),
    (
        "added-empty",
        _set("added_tokens.0.content", ""),
        "expected an added token's content to be a non-empty string, got ''",
    ),
    (
        "added-no-id",
        _set("added_tokens.0.id", KeyError),
        "expected an int id for added token '<|endoftext|>', got None",
    ),
    (
        "added-string-id",
        _set("added_tokens.0.id", "258"),
        "expected an int id for added token '<|endoftext|>', got '258'",
    ),
]


@pytest.mark.parametrize(("change", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_tokenizer_json_is_refused_in_one_line(tmp_path, change, message):
    if isinstance(change, bytes):
        data = change
    else:
        document = document_of(small())
        change(document)
        data = json.dumps(document).encode("utf-8")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(data)
    for read in (Tokenizer.from_hf, Tokenizer.load):
        with pytest.raises(ValueError) as raised:
            read(folder)
        assert str(raised.value) == f"{folder / 'tokenizer.json'}: {message}" or (
            str(raised.value).startswith(f"{folder / 'tokenizer.json'}: ") and message in str(raised.value)
        )
        assert "\n" not in str(raised.value)


def test_from_hf_needs_a_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="path must be a tokenizer.json or a folder holding one"):
        Tokenizer.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf(tmp_path / "absent.json")


def test_gpt2_patterns_are_gpt2s():
    # The two spellings accepted for a Split pre-tokenizer split every string alike (regex runs both).
    import regex

    first, second = (regex.compile(pattern) for pattern in sorted(module.GPT2_PATTERNS))
    for text in [*SAMPLES, "'s'S 'll'LL x's 'd'D 're've 'm 't", "a'ss \t\n 12x"]:
        assert first.findall(text) == second.findall(text)

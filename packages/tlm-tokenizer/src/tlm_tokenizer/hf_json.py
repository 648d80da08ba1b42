"""HF tokenizers' ``tokenizer.json``, for the one kind of tokenizer tlm reproduces: byte-level BPE.

tlm writes what HF's own GPT-2 file holds: a BPE model (the vocab in GPT-2's byte-level characters,
the merges in rank order), the ByteLevel pre-tokenizer (GPT-2's pattern, no prefix space), ByteLevel
post-processor and decoder, no normalizer, and the special tokens as ``added_tokens`` (special, not
normalized). Beside it, ``tokenizer_config.json`` tells transformers' ``AutoTokenizer`` to use the
file as it is. Reading accepts such a file whoever wrote it (HF's GPT-2 file, HF ``save``, tlm) and
refuses, naming the one thing that differs, any file that HF would encode differently from tlm.
"""

import json
from typing import Any, TypeGuard

from tlm_core.checks import short_repr
from tlm_tokenizer.gpt2_format import parse_json, text_to_token, token_to_text

__all__ = ["TOKENIZER_CONFIG_JSON", "TOKENIZER_JSON", "config_json", "from_json", "to_json"]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
EOS_TOKEN = "<|endoftext|>"
# GPT-2's pattern as tlm writes it and as HF spells it inside its ByteLevel pre-tokenizer; a Split
# pre-tokenizer with either one, followed by ByteLevel without its own regex, is the same thing.
GPT2_PATTERNS = frozenset(
    {
        r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    }
)
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def to_json(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], special_tokens: list[str]) -> bytes:
    """The bytes of a ``tokenizer.json`` holding this vocab, these merges (rank = position) and specials.

    A special token is written into ``model.vocab`` under its own text, not its bytes' byte-level text
    (they differ for a space or a non-ASCII character): HF takes an added token's id from there, and
    gives one that is missing the next free id, whatever ``added_tokens`` says.
    """
    ids = {token: index for index, token in vocab.items()}
    texts = {index: token_to_text(token) for index, token in sorted(vocab.items())}
    for token in special_tokens:
        texts[ids[token.encode("utf-8")]] = token
    model_vocab: dict[str, int] = {}
    for index, text in texts.items():
        if text in model_vocab:  # only a special token's text can equal another token's byte-level text
            raise ValueError(
                f"special_tokens: {text!r} is also the byte-level text of another token (ids {model_vocab[text]} and "
                f"{index}), which tokenizer.json cannot hold both of"
            )
        model_vocab[text] = index
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": ids[token.encode("utf-8")],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token in special_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": _BYTE_LEVEL,
        # As HF's GPT-2 file: these two flags only shape offsets and the decoder's handling of them.
        "post_processor": {**_BYTE_LEVEL, "add_prefix_space": True, "trim_offsets": False},
        "decoder": {**_BYTE_LEVEL, "add_prefix_space": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": model_vocab,
            # "left right" strings: every version of HF tokenizers reads them, and a byte-level token
            # never holds a space (GPT-2's alphabet writes the space byte as "Ġ").
            "merges": [f"{token_to_text(left)} {token_to_text(right)}" for left, right in merges],
        },
    }
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def config_json(special_tokens: list[str], chat_template: str | None = None) -> bytes:
    """The bytes of a ``tokenizer_config.json`` with which ``AutoTokenizer`` loads ``tokenizer.json``
    unchanged: the generic fast class, no clean-up of spaces when decoding, ``<|endoftext|>`` as the
    end-of-sequence token when the tokenizer has it, and the ``chat_template`` when there is one (what
    transformers' ``apply_chat_template`` renders)."""
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if EOS_TOKEN in special_tokens:
        config["eos_token"] = EOS_TOKEN
    if chat_template is not None:
        config["chat_template"] = chat_template
    return (json.dumps(config, indent=2) + "\n").encode("utf-8")


def from_json(data: bytes, where: str) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str]]:
    """``(vocab, merges, special_tokens)`` from the bytes of a ``tokenizer.json`` (``where`` names it).

    Raises ValueError, in one line naming ``where``, for a file that is not JSON, is not shaped like a
    tokenizer.json, or describes a tokenizer that tlm would not reproduce exactly.
    """
    document = parse_json(data, where)
    if not isinstance(document, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(document).__name__}")
    for key in ("normalizer", "truncation", "padding"):
        if document.get(key) is not None:
            raise ValueError(f"{where}: expected no {key}, got {_describe(document[key])}")
    _check_pre_tokenizer(document.get("pre_tokenizer"), where)
    decoder = document.get("decoder")
    if not _is_type(decoder, "ByteLevel"):
        raise ValueError(f"{where}: expected a ByteLevel decoder, got {_describe(decoder)}")
    post = document.get("post_processor")
    if post is not None and not _is_type(post, "ByteLevel"):
        raise ValueError(f"{where}: expected no post_processor or a ByteLevel one, got {_describe(post)}")
    model = _field(document, "model", dict, where)
    added = _added_tokens(document.get("added_tokens", []), where)
    vocab = _vocab(model, added, where)
    merges = _merges(model, where)
    # HF gives an added token the id model.vocab has for its text, else the next free one (whatever
    # its "id" says); ids that HF would not give are refused rather than followed or contradicted.
    in_model = len(vocab)
    given: list[int] = []
    for content, stated in added.items():
        found = _model_id(model, content)
        if found is None:
            found = in_model if not given or (max(given) < in_model and in_model) else max(given) + 1
            if found != stated:
                raise ValueError(
                    f"{where}: added token {content!r} has id {stated}, but HF tokenizers gives it {found} "
                    "(its text is not in model.vocab)"
                )
            vocab[found] = content.encode("utf-8")
        elif found != stated:
            raise ValueError(f"{where}: added token {content!r} has id {stated}, but model.vocab gives it {found}")
        given.append(found)
    return vocab, merges, list(added)


def _model_id(model: dict[str, Any], content: str) -> int | None:
    index = model["vocab"].get(content)
    return index if isinstance(index, int) else None


def _check_pre_tokenizer(pre: object, where: str) -> None:
    if _is_type(pre, "Sequence"):
        steps = pre.get("pretokenizers")
        if (
            isinstance(steps, list)
            and len(steps) == 2
            and _is_type(steps[0], "Split")
            and _is_type(steps[1], "ByteLevel")
        ):
            split, byte_level = steps
            pattern = split.get("pattern")
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if regex not in GPT2_PATTERNS:
                raise ValueError(f"{where}: expected GPT-2's pre-tokenization pattern, got {short_repr(regex)}")
            if split.get("behavior") != "Isolated" or split.get("invert", False):
                raise ValueError(f"{where}: expected the Split pre-tokenizer to isolate its matches, got {split}")
            if byte_level.get("use_regex", True):
                raise ValueError(f"{where}: expected ByteLevel after Split to have use_regex false, got true")
            _check_prefix_space(byte_level, where)
            return
    if not _is_type(pre, "ByteLevel"):
        raise ValueError(f"{where}: expected a ByteLevel pre-tokenizer with GPT-2's pattern, got {_describe(pre)}")
    if not pre.get("use_regex", True):
        raise ValueError(
            f"{where}: expected the ByteLevel pre-tokenizer to split with GPT-2's pattern, got use_regex false"
        )
    _check_prefix_space(pre, where)


def _check_prefix_space(byte_level: dict[str, Any], where: str) -> None:
    if byte_level.get("add_prefix_space", False):
        raise ValueError(f"{where}: expected add_prefix_space false in the pre-tokenizer, got true")


def _vocab(model: dict[str, Any], added: dict[str, int], where: str) -> dict[int, bytes]:
    """id -> bytes of ``model.vocab``: byte-level text, except an added token's own text (see to_json)."""
    if model.get("type", "BPE") != "BPE":
        raise ValueError(f"{where}: expected a BPE model, got {short_repr(model.get('type'))}")
    for key, allowed in (
        ("dropout", (None, 0, 0.0)),
        ("unk_token", (None,)),
        ("continuing_subword_prefix", (None, "")),
        ("end_of_word_suffix", (None, "")),
        ("byte_fallback", (None, False)),
        ("ignore_merges", (None, False)),
    ):
        value = model.get(key)
        if not any(value is option or (value == option and type(value) is type(option)) for option in allowed):
            raise ValueError(f"{where}: expected model.{key} {_options(allowed)}, got {short_repr(value)}")
    raw = _field(model, "vocab", dict, where, "model.")
    vocab: dict[int, bytes] = {}
    for text, index in raw.items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"{where}: expected int ids in model.vocab, got {short_repr(index)} for {short_repr(text)}"
            )
        if index in vocab:
            raise ValueError(f"{where}: expected distinct ids in model.vocab, got {index} twice")
        vocab[index] = text.encode("utf-8") if text in added else text_to_token(text, where)
    return vocab


def _merges(model: dict[str, Any], where: str) -> list[tuple[bytes, bytes]]:
    merges = []
    tokens: dict[str, bytes] = {}  # each token is a part of many merges: convert it once
    for rank, merge in enumerate(_field(model, "merges", list, where, "model.")):
        parts = merge.split(" ") if isinstance(merge, str) else merge if isinstance(merge, list) else []
        if len(parts) != 2 or not all(isinstance(part, str) for part in parts):
            raise ValueError(
                f"{where}: expected each merge as 'left right' or [left, right], got {short_repr(merge)} at {rank}"
            )
        left, right = (tokens.get(part) or tokens.setdefault(part, text_to_token(part, where)) for part in parts)
        merges.append((left, right))
    return merges


def _added_tokens(added: object, where: str) -> dict[str, int]:
    """The added tokens' contents -> stated ids, in file order."""
    if not isinstance(added, list):
        raise ValueError(f"{where}: expected added_tokens to be a list, got {type(added).__name__}")
    tokens: dict[str, int] = {}
    normalized: set[bool] = set()
    for entry in added:
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected each added token to be an object, got {short_repr(entry)}")
        content, index = entry.get("content"), entry.get("id")
        if not isinstance(content, str) or not content:
            raise ValueError(
                f"{where}: expected an added token's content to be a non-empty string, got {short_repr(content)}"
            )
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}: expected an int id for added token {content!r}, got {short_repr(index)}")
        for flag in ("single_word", "lstrip", "rstrip"):
            if entry.get(flag, False):
                raise ValueError(f"{where}: expected added token {content!r} without {flag}, got {flag} true")
        if content in tokens:
            raise ValueError(f"{where}: expected each added token once, got {content!r} twice")
        normalized.add(bool(entry.get("normalized", False)))
        tokens[content] = index
    if len(normalized) > 1:
        # HF matches normalized and raw added tokens in two passes; tlm matches all in one.
        raise ValueError(f"{where}: expected added tokens all normalized or all not, got both")
    return tokens


def _field(document: dict[str, Any], key: str, kind: type, where: str, prefix: str = "") -> Any:
    if key not in document:
        raise ValueError(f"{where}: expected a key {prefix}{key}, got none")
    value = document[key]
    if not isinstance(value, kind):
        got = _JSON_NAMES.get(type(value), type(value).__name__)
        raise ValueError(f"{where}: expected {prefix}{key} to be a {_JSON_NAMES[kind]}, got {got}")
    return value


_JSON_NAMES = {
    dict: "JSON object",
    list: "JSON array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _is_type(component: object, name: str) -> TypeGuard[dict[str, Any]]:
    return isinstance(component, dict) and component.get("type") == name


def _describe(component: object) -> str:
    if component is None:
        return "null"
    if isinstance(component, dict) and "type" in component:
        return f"a {short_repr(component['type'])} one"
    return short_repr(component)


def _options(allowed: tuple[object, ...]) -> str:
    return " or ".join("null" if option is None else json.dumps(option) for option in allowed)

"""Chat data for supervised fine-tuning: JSON Lines conversations to token ids whose targets are masked.

A chat file is JSON Lines whose records are OpenAI's chat format, ``{"messages": [{"role", "content"}, ...]}``,
or ``{"prompt", "completion"}`` pairs (strings: a user turn and the assistant's answer; or lists of messages,
TRL's conversational form). Each conversation is rendered with the run's chat template (by default ChatML,
its markers special tokens of the tokenizer: :mod:`tlm_tokenizer.chat`) and encoded; ``train_on`` picks the
tokens the loss counts (the assistant's by default).

The mask travels inside the token array, so every path that cuts windows (the sampler, evaluation, a resume)
carries it with no second file: a token the loss must skip as a target is stored as ``-1 - id`` in a signed
array, and :func:`split_targets` turns a window back into ids and targets with ``IGNORE_INDEX`` (-100) there.
Examples are packed (joined by ``<|endoftext|>``, which is never a target, windows cut anywhere; with
``--document-mask`` they do not see each other) or padded (one example per row of ``context_length + 1``
tokens, cut or filled with ``<|endoftext|>``, windows aligned to the rows).
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tlm_tokenizer.chat import check_messages
from tlm_train.sources import is_jsonl, json_lines, open_binary


def _first_record(path: str | Path) -> object:
    """The first record of ``path``, or None when it is not one (the text reader then says why, naming the line)."""
    with open_binary(path) as stream:
        try:
            line = next((line for _, line in json_lines(path, stream) if line.strip()), "")
            return json.loads(line)
        except (ValueError, RecursionError):
            return None


def is_chat_file(path: str | Path, text_field: str = "text") -> bool:
    """Whether ``path`` is JSON Lines of conversations: its first record has ``messages``, or ``prompt`` and
    ``completion``, and no ``text_field``."""
    if not is_jsonl(path):
        return False
    record = _first_record(path)
    if not isinstance(record, dict) or text_field in record:
        return False
    return "messages" in record or {"prompt", "completion"} <= set(record)


def conversations(path: str | Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """``(line number, messages)`` for each record of a chat file, in OpenAI's message format."""
    with open_binary(path) as stream:
        for number, line in json_lines(path, stream):  # one record at most MAX_RECORD_BYTES, as for text data
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"--data {path} line {number}: not JSON ({err})") from None
            except RecursionError:
                raise ValueError(f"--data {path} line {number}: not JSON (nested too deeply)") from None
            where = f"--data {path} line {number}"
            yield number, check_messages(_messages(record, where), where)


def _messages(record: object, where: str) -> Any:
    if isinstance(record, dict) and "messages" in record:
        return record["messages"]
    if isinstance(record, dict) and {"prompt", "completion"} <= set(record):
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if isinstance(prompt, list) and isinstance(completion, list):
            return prompt + completion
        raise ValueError(f"{where}: prompt and completion must both be strings or both lists of messages")
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: expected {{'messages': [...]}} or {{'prompt', 'completion'}}, got {keys}")


def encode_examples(paths: list[str], template: Any, train_on: str) -> list[np.ndarray]:
    """Each conversation of ``paths`` as a signed int64 array: ids, with ``-1 - id`` where the loss skips the
    token as a target (``template`` is a :class:`tlm_tokenizer.chat.ChatTemplate`)."""
    examples = []
    for path in paths:
        for number, messages in conversations(path):
            encoded = template.encode(messages, where=f"--data {path} line {number}")
            ids = np.asarray(encoded.ids, dtype=np.int64)
            trained = np.asarray(encoded.trained(train_on), dtype=bool)
            examples.append(np.where(trained, ids, -1 - ids))
    return examples


def lay_out(examples: list[np.ndarray], layout: str, separator: int, row_length: int) -> tuple[np.ndarray, int]:
    """The examples as one int32 array and the number cut short: packed (joined by ``separator``, never a
    target) or padded (each its own row of ``row_length``, cut, or filled with ``separator``)."""
    skip = -1 - separator
    if layout == "packed":
        pieces = []
        for i, example in enumerate(examples):
            pieces += [np.asarray([skip])] if i else []
            pieces.append(example)
        return np.concatenate(pieces).astype(np.int32), 0
    rows = np.full((len(examples), row_length), skip, dtype=np.int32)
    cut = 0
    for i, example in enumerate(examples):
        cut += len(example) > row_length
        rows[i, : min(len(example), row_length)] = example[:row_length]
    return rows.reshape(-1), cut


def split_targets(rows: Any) -> tuple[Any, Any]:
    """(inputs, targets) of windows of ``context_length + 1`` stored tokens (numpy or torch, int64): the ids, and
    the next ids with ``IGNORE_INDEX`` where a token is not a target."""
    import torch

    from tlm_model.loss import IGNORE_INDEX

    ids = torch.where(rows < 0, -1 - rows, rows)
    return ids[:, :-1], torch.where(rows[:, 1:] < 0, IGNORE_INDEX, rows[:, 1:])

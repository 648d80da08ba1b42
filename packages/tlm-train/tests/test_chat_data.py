"""Chat data's stored form (the module docstring): each conversation's ids with ``-1 - id`` where the loss skips the
token as a target, laid out packed or padded, and split back into the ids and targets with ``-100`` there."""

import inspect
import json

import numpy as np
import torch
import torch.nn.functional as F

from tlm_tokenizer import Tokenizer
from tlm_tokenizer.chat import CHAT_MARKERS, ChatTemplate
from tlm_train.chat_data import encode_examples, lay_out, split_targets


def test_skipped_targets_are_stored_as_minus_one_minus_the_id_and_split_back(tmp_path):
    template = ChatTemplate(Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>", *CHAT_MARKERS]))
    records = [{"prompt": "hi", "completion": "yo"},
               {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]}]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    examples = encode_examples([str(path)], template, "completion")
    conversations = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        records[1]["messages"],
    ]
    assert len(examples) == 2
    for stored, messages in zip(examples, conversations, strict=True):
        encoded = template.encode(messages)  # tlm_tokenizer's ids and assistant mask
        ids, counted = encoded.ids, encoded.trained("completion")
        assert 0 < sum(counted) < len(ids)
        assert stored.dtype == np.int64
        assert stored.tolist() == [i if c else -1 - i for i, c in zip(ids, counted, strict=True)]
        inputs, targets = split_targets(torch.from_numpy(stored)[None])
        assert inputs[0].tolist() == ids[:-1]
        ignored = inspect.signature(F.cross_entropy).parameters["ignore_index"].default  # -100: torch skips it
        assert targets[0].tolist() == [i if c else ignored for i, c in zip(ids[1:], counted[1:], strict=True)]


def test_examples_are_packed_with_the_separator_or_padded_and_cut_to_rows():
    examples = [np.array([1, -3, 4]), np.array([5, 6, -8, 9, 10, 11])]
    skip = -1 - 2  # the separator (id 2) is never a target
    packed, cut = lay_out(examples, "packed", 2, 4)
    assert packed.dtype == np.int32 and cut == 0
    assert packed.tolist() == [1, -3, 4, skip, 5, 6, -8, 9, 10, 11]
    padded, cut = lay_out(examples, "padded", 2, 4)
    assert padded.dtype == np.int32 and cut == 1  # the second example is cut to its row
    assert padded.tolist() == [1, -3, 4, skip, 5, 6, -8, 9]

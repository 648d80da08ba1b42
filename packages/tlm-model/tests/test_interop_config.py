"""``config_from_hf``'s required keys: the six sizes a ``config.json`` must give (each refused by name when missing,
where transformers' ``LlamaConfig`` would quietly fill in Llama-2-7B's), and the two it may leave out, which are read
as transformers reads them."""

import json
import re

import pytest

from tlm_model.interop import config_from_hf

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": 64, "max_position_embeddings": 16, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "intermediate_size": 48}  # fmt: skip


def _config() -> dict:
    return json.loads(transformers.LlamaConfig(**SIZES).to_json_string())


@pytest.mark.parametrize("key", sorted(SIZES))
def test_a_config_without_one_of_the_six_sizes_is_refused_naming_it(key):
    hf = _config()
    del hf[key]
    assert getattr(transformers.LlamaConfig(**hf), key) != SIZES[key]  # what transformers would build instead
    with pytest.raises(ValueError, match=re.escape(f"config.json lacks ['{key}']")):
        config_from_hf(hf)


def test_the_kv_head_count_and_head_dim_may_be_left_out_as_in_transformers():
    hf = _config()
    del hf["num_key_value_heads"], hf["head_dim"]
    read, config = transformers.LlamaConfig(**hf), config_from_hf(hf)
    assert (config.kv_heads, config.d_head) == (read.num_key_value_heads, read.head_dim) == (4, 8)
    assert config == config_from_hf(_config())  # the same as spelling them out

"""Bad input, end to end: what a user gets from every public module and function.

Each row of the table in docs/reliability.md ("Bad input") is one case here, under the same id;
``test_every_documented_row_is_a_test`` keeps the two in step, and the "Errors" table is generated
from ``RAISES`` (``python packages/tlm-model/tests/test_bad_input.py``). The model package depends on
every other tlm package, so this one file can exercise them all; a message that a leaf package's own
tests pin (it installs and tests alone) is not pinned again here: its row names that ``owner`` and the
docs quote what the call raises.
"""

import dataclasses
import pathlib
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tlm_attention import (
    CausalMultiHeadSelfAttention,
    causal_attention,
    scaled_dot_product_attention,
    softmax,
)
from tlm_ffn import SwiGLU, silu
from tlm_linear import Embedding, Linear
from tlm_model import ModelConfig, TransformerBlock, TransformerLM, chunked_cross_entropy
from tlm_norm import RMSNorm
from tlm_rope import RotaryPositionalEmbedding


def block_config(d_model, num_heads, d_ff, max_seq_len=16, theta=10_000.0, **fields):
    # One block's sizes as a ModelConfig; a block uses neither the vocabulary nor the depth.
    return ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, rope_theta=theta, **fields)


CFG = ModelConfig(vocab_size=11, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
U16 = torch.uint16
DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "reliability.md"


def lm(**options) -> TransformerLM:
    return TransformerLM(CFG, **options)


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape)


def rope(d_k: int = 8, max_seq_len: int = 8) -> RotaryPositionalEmbedding:
    return RotaryPositionalEmbedding(10_000.0, d_k, max_seq_len)


def mha(**options) -> CausalMultiHeadSelfAttention:
    return CausalMultiHeadSelfAttention(16, 2, rope=rope(), **options)


def block() -> TransformerBlock:
    return TransformerBlock(block_config(16, 2, 24, max_seq_len=8))


def qkv(queries: int = 3, keys: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(2, queries, 4), torch.randn(2, keys, 4), torch.randn(2, keys, 6)


def sdpa_with_mask(mask: object) -> torch.Tensor:
    return scaled_dot_product_attention(*qkv(), mask)


def load_into_lm(edit: Callable[[dict], None]) -> None:
    state = lm().state_dict()
    edit(state)
    lm().load_state_dict(state)


def _replace(state: dict, key: str, value: torch.Tensor) -> None:
    state[key] = value


# --------------------------------------------------------------------------- rows that raise


@dataclass(frozen=True)
class Raises:
    id: str
    input: str  # the docs' "input" column
    call: Callable[[], object]
    exception: type[Exception]
    message: str  # a literal substring of the message (escaped before matching), quoted in the docs
    note: str = ""  # said in the docs after the message
    # The test file (under packages/) of the package that owns this message and pins it there, because that
    # package installs and tests alone. Such a row is the docs' row only: ``message`` stays empty, the docs
    # quote what ``call`` raises, and test_raises leaves the row to its owner.
    owner: str = ""


# docs/reliability.md's "Errors" table is generated from this list (python packages/tlm-model/tests/
# test_bad_input.py), and test_the_errors_table_is_generated_from_raises fails when the two differ. Each
# message is pinned once: here, or (a row with an ``owner``) by the tests of the leaf package that raises it.
# Only constructors, loaders and the public functions check their arguments;
# a module's forward does not (the annotations state the shapes), so a wrong dtype or shape there gets
# torch's own error, and values are never read back to the host: ids and positions outside their tables
# are refused by the lookup's kernel (index_select), not by a comparison on the host.
RAISES = [
    # wrong dtype, rank or shape, given to the public functions
    Raises("silu-int-activations", "`silu`, int32", lambda: silu(torch.ones(3, dtype=torch.int32)), TypeError,
           "", owner="tlm-ffn/tests/test_swiglu.py"),
    Raises("rope-int-activations", "`RotaryPositionalEmbedding`, int64",
           lambda: rope()(torch.ones(3, 8, dtype=torch.long)), TypeError,
           "", owner="tlm-rope/tests/test_rope.py"),
    Raises("softmax-int-activations", "`softmax`, int64", lambda: softmax(torch.arange(3), 0), TypeError,
           "", owner="tlm-attention/tests/test_softmax.py"),
    Raises("sdpa-int-activations", "`scaled_dot_product_attention`, int64 Q",
           lambda: scaled_dot_product_attention(torch.ones(3, 4, dtype=torch.long), *qkv()[1:]), TypeError,
           "", "(K, V likewise)", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("rope-1d", "RoPE given a 1-d tensor", lambda: rope()(torch.randn(8)), ValueError,
           "x must have shape (..., seq, d_k=8), got (8,)"),
    Raises("sdpa-1d", "SDPA given a 1-d Q", lambda: scaled_dot_product_attention(torch.randn(4), *qkv()[1:]),
           ValueError, "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("sdpa-d_k-mismatch", "Q and K with different last dimensions",
           lambda: scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 6)),
           ValueError, "Q and K must share their last dimension d_k, got Q (2, 3, 4) and K (2, 5, 3)"),
    Raises("sdpa-keys-mismatch", "K and V with different numbers of keys",
           lambda: scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 4, 6)),
           ValueError, "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("sdpa-batch-mismatch", "leading dimensions that do not broadcast",
           lambda: scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(3, 5, 4), torch.randn(3, 5, 6)),
           ValueError, "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("softmax-dim-out-of-range", "`dim=2` for a rank-2 tensor", lambda: softmax(torch.randn(2, 3), 2),
           ValueError, "", owner="tlm-attention/tests/test_softmax.py"),
    Raises("rope-positions-wrong-shape", "4 positions for a 3-token input",
           lambda: rope()(torch.randn(2, 3, 8), torch.arange(4)), ValueError,
           "", owner="tlm-rope/tests/test_rope.py"),
    # ids and positions outside their tables: refused by the lookup, never wrapped
    Raises("lm-ids-too-large", "id 11 with vocab 11", lambda: lm()(torch.tensor([[0, 11]])), IndexError,
           "index out of range in self",
           "(from `index_select`, the embedding's lookup; on an accelerator a device-side assert)"),
    Raises("lm-negative-ids", "id −1", lambda: lm()(torch.tensor([[-1, 3]])), IndexError,
           "index out of range in self", "(indexing would have wrapped it to the end of the table)"),
    Raises("lm-uint16-ids-too-large", "uint16 id 300 with vocab 11",
           lambda: lm()(torch.tensor([[0, 300]], dtype=torch.uint16)), IndexError, "index out of range in self",
           "(narrow integer ids are widened to int64 first, never read as a mask)"),
    Raises("rope-position-too-large", "position 8 with max_seq_len 8",
           lambda: rope()(torch.randn(3, 8), torch.tensor([0, 1, 8])), IndexError, "",
           owner="tlm-rope/tests/test_rope.py"),
    Raises("rope-negative-position", "position −1", lambda: rope()(torch.randn(3, 8), torch.tensor([-1, 0, 1])),
           IndexError, "", owner="tlm-rope/tests/test_rope.py"),
    Raises("lm-uint8-position-too-large", "uint8 positions 6–8 through the LM (context 8)",
           lambda: lm()(ids(1, 3), torch.tensor([6, 7, 8], dtype=torch.uint8)), IndexError,
           "index out of range in self", "(uint8 positions are widened, not read as a mask)"),
    Raises("loss-uint16-targets-too-large", "`chunked_cross_entropy` with uint16 target 11, vocab 11",
           lambda: chunked_cross_entropy(torch.randn(2, 16), torch.randn(11, 16), torch.tensor([0, 11]).to(U16)),
           RuntimeError, "index 11 is out of bounds for dimension 1 with size 11", "(from `gather`)"),
    # too long
    Raises("lm-too-long", "9 tokens, context 8", lambda: lm()(ids(1, 9)), ValueError,
           "x has seq=9 positions but the tables hold max_seq_len=8",
           "(the RoPE tables hold `context_length` positions)"),
    Raises("rope-too-long", "9 positions, max_seq_len 8, no explicit positions", lambda: rope()(torch.randn(9, 8)),
           ValueError, "", owner="tlm-rope/tests/test_rope.py"),
    Raises("kv-cache-full", "a decoding step past a 4-token KV cache's capacity", lambda: _past_the_cache(),
           ValueError, "the KV cache holds 4 tokens; 4 stored + 1 new is too many", "(no cache is changed)"),
    # masks
    Raises("sdpa-mask-not-broadcastable", "mask (3, 4) for scores (2, 3, 5)",
           lambda: sdpa_with_mask(torch.ones(3, 4, dtype=torch.bool)), ValueError,
           "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("sdpa-mask-1d", "a 1-d mask (5,), though it would broadcast",
           lambda: sdpa_with_mask(torch.ones(5, dtype=torch.bool)), ValueError,
           "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("sdpa-mask-float", "a float mask", lambda: sdpa_with_mask(torch.ones(3, 5)), TypeError,
           "", owner="tlm-attention/tests/test_sdpa.py"),
    Raises("sdpa-mask-int", "an int64 mask", lambda: sdpa_with_mask(torch.ones(3, 5, dtype=torch.long)), TypeError,
           "mask must have dtype torch.bool (True = may attend), got torch.int64; an additive float mask is not "
           "supported"),
    Raises("sdpa-mask-not-a-tensor", "a nested list", lambda: sdpa_with_mask([[True] * 5] * 3), TypeError,
           "mask must be a torch.Tensor of dtype torch.bool, got list"),
    # state dicts (torch's load_state_dict, strict=True by default)
    Raises("state-dict-missing-key", "`load_state_dict` without `lm_head.weight`",
           lambda: load_into_lm(lambda sd: sd.pop("lm_head.weight")), RuntimeError,
           'Error(s) in loading state_dict for TransformerLM:\n\tMissing key(s) in state_dict: "lm_head.weight". ',
           "(torch's message)"),
    Raises("state-dict-unexpected-key", "an extra key `extra.weight`",
           lambda: load_into_lm(lambda sd: _replace(sd, "extra.weight", torch.ones(1))), RuntimeError,
           'Error(s) in loading state_dict for TransformerLM:\n\tUnexpected key(s) in state_dict: "extra.weight". '),
    Raises("state-dict-wrong-shape", "`lm_head.weight` of shape (3, 3)",
           lambda: load_into_lm(lambda sd: _replace(sd, "lm_head.weight", torch.ones(3, 3))), RuntimeError,
           "Error(s) in loading state_dict for TransformerLM:\n\tsize mismatch for lm_head.weight: copying a param "
           "with shape torch.Size([3, 3]) from checkpoint, the shape in current model is torch.Size([11, 16])."),
    # hyperparameters
    Raises("rope-odd-d_k", "`RotaryPositionalEmbedding(10000.0, 7, 8)`",
           lambda: RotaryPositionalEmbedding(10_000.0, 7, 8), ValueError,
           "", owner="tlm-rope/tests/test_rope.py"),
    Raises("config-odd-head-dim", "`ModelConfig` with d_model 15, 5 heads",
           lambda: ModelConfig(vocab_size=11, context_length=8, d_model=15, num_layers=1, num_heads=5, d_ff=8),
           ValueError, "ModelConfig: d_model / num_heads must be even for RoPE, got 3"),
    Raises("mha-heads-not-dividing", "`CausalMultiHeadSelfAttention(10, 3)`",
           lambda: CausalMultiHeadSelfAttention(10, 3), ValueError,
           "", owner="tlm-attention/tests/test_mha.py"),
    Raises("config-heads-not-dividing",
           "`ModelConfig` with d_model 10, 3 heads (what every block and LM is built from)",
           lambda: ModelConfig(11, 8, 10, 1, 3, 8), ValueError,
           "ModelConfig.d_model must be divisible by num_heads, got d_model=10, num_heads=3"),
    Raises("lm-not-a-config", "`TransformerLM(11, 8, 10, 1, 3, 8)`: the 0.2 scalar signature",
           lambda: TransformerLM(11, 8, 10, 1, 3, 8), TypeError,
           "__init__() takes 2 positional arguments but 7 were given"),
    Raises("lm-dict-config", "`TransformerLM({...})`", lambda: TransformerLM(CFG.to_dict()), TypeError,
           "config must be a ModelConfig, got dict"),
    Raises("block-dict-config", "`TransformerBlock({...})`", lambda: TransformerBlock(CFG.to_dict()), TypeError,
           "config must be a ModelConfig, got dict"),
    Raises("config-unknown-field", '`ModelConfig.from_dict` with `"dropout"`',
           lambda: ModelConfig.from_dict({**CFG.to_dict(), "dropout": 0.1}), ValueError,
           "unknown ModelConfig fields ['dropout']; expected a subset of", "(then every field's name)"),
    Raises("mha-positions-without-rope", "positions given to attention built without RoPE",
           lambda: CausalMultiHeadSelfAttention(16, 2)(torch.randn(3, 16), torch.arange(3)), ValueError,
           "", owner="tlm-attention/tests/test_mha.py"),
    # wiring
    Raises("kv-cache-other-rows", "a cached step of 2 rows of ids over a 1-row KV cache",
           lambda: lm()(ids(2, 1), kv_cache=lm().new_kv_cache(1)), ValueError,
           "with a kv_cache in_indices must have shape (rows=1, seq), got (2, 1)", "(nothing is written)"),
    Raises("mha-unknown-backend", '`attention_backend="flash"` when building attention',
           lambda: mha(attention_backend="flash"), ValueError,
           "", owner="tlm-attention/tests/test_backends.py"),
    Raises("causal-attention-unknown-backend", "the same name given to `causal_attention`",
           lambda: causal_attention(*torch.randn(3, 2, 4, 8), attention_backend="flash"), ValueError,
           "", owner="tlm-attention/tests/test_backends.py"),
    Raises("lm-unknown-backend", "the same name given to `TransformerLM`", lambda: lm(attention_backend="flash"),
           ValueError, "attention_backend must be one of ('auto', 'reference', 'blockwise', 'torch'), got 'flash'",
           "(before any weight is allocated)"),
    Raises("lm-backends-disagree", "`model.attention_backend` read after one layer's backend was changed alone",
           lambda: _disagreeing_backends().attention_backend, ValueError,
           "the layers use different attention backends: ['auto', 'reference']; set model.attention_backend"),
]  # fmt: skip


def _two_layers() -> TransformerLM:
    return TransformerLM(dataclasses.replace(CFG, num_layers=2))


def _past_the_cache() -> torch.Tensor:
    model = lm()
    cache = model.new_kv_cache(1, capacity=4)
    model(ids(1, 4), kv_cache=cache)
    try:
        return model(ids(1, 1), kv_cache=cache)
    finally:
        assert cache.lengths == (4,)


def _disagreeing_backends() -> TransformerLM:
    model = _two_layers()
    model.layers[1].attn.attention_backend = "reference"
    return model


PINNED_HERE = [row for row in RAISES if not row.owner]


@pytest.mark.parametrize("row", PINNED_HERE, ids=[row.id for row in PINNED_HERE])
def test_raises(row):
    with pytest.raises(row.exception, match=re.escape(row.message)):
        row.call()


def _raised(row: Raises) -> str:
    """What ``row.call`` raises, for the docs' row of a message its owner's tests pin (inside pytest.raises,
    where the tests' conftest pauses the shape checker, as a user runs without it)."""
    with pytest.raises(row.exception) as info:
        row.call()
    return str(info.value)


# ----------------------------------------------------------- rows whose documented behaviour is not an error


def _lm_batch_dims():
    out = lm()(ids(2, 3, 4))
    assert out.shape == (2, 3, 4, CFG.vocab_size)


def _lm_empty_batch():
    assert lm()(torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4, CFG.vocab_size)


def _lm_empty_sequence():
    assert lm()(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, CFG.vocab_size)


def _lm_uint8_ids():
    tokens = ids(2, 4)
    torch.testing.assert_close(lm_fixed()(tokens.to(torch.uint8)), lm_fixed()(tokens), rtol=0, atol=0)


def lm_fixed() -> TransformerLM:
    torch.manual_seed(1)
    return lm()


def _empty_passes_through(module_call, shape):
    def check():
        assert module_call(torch.randn(shape)).shape[: len(shape) - 1] == shape[:-1]

    return check


def _lm_every_integer_dtype():
    tokens = ids(2, 4)
    expected = lm_fixed()(tokens)
    for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32):
        torch.testing.assert_close(lm_fixed()(tokens.to(dtype)), expected, rtol=0, atol=0)


def _rope_uint8_positions():
    x, positions = torch.randn(3, 8), torch.tensor([1, 0, 1])
    torch.testing.assert_close(rope()(x, positions.to(torch.uint8)), rope()(x, positions), rtol=0, atol=0)


def _rmsnorm_huge_input():
    x = torch.randn(3, 4)
    out = RMSNorm(4)(x * 1e30)  # (x·1e30)² overflows float32
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (4,), eps=0.0), rtol=1e-5, atol=1e-6)


def _lm_kv_step_interrupted():
    model = _two_layers()
    cache = model.new_kv_cache(1)
    model(ids(1, 3), kv_cache=cache)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    hook = model.layers[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(ids(1, 1), kv_cache=cache)
    hook.remove()
    assert cache.lengths == (3,)


def _lm_pickles():
    model = lm()
    tokens = ids(1, 4)
    torch.testing.assert_close(pickle.loads(pickle.dumps(model))(tokens), model(tokens), rtol=0, atol=0)


def _mha_empty_sequence(backend):
    def check():
        assert mha(attention_backend=backend)(torch.randn(2, 0, 16)).shape == (2, 0, 16)

    return check


BEHAVES = {
    "lm-extra-batch-dims": _lm_batch_dims,
    "lm-empty-batch": _lm_empty_batch,
    "lm-empty-sequence": _lm_empty_sequence,
    "lm-uint8-ids": _lm_uint8_ids,
    "rope-empty-sequence": _empty_passes_through(rope(), (2, 0, 8)),
    "linear-empty": _empty_passes_through(Linear(4, 3), (0, 4)),
    "rmsnorm-empty": _empty_passes_through(RMSNorm(4), (0, 4)),
    "embedding-empty-ids": lambda: Embedding(11, 4)(torch.zeros(0, dtype=torch.long)).shape == (0, 4),
    "softmax-empty-dim": lambda: softmax(torch.randn(2, 0), -1).shape == (2, 0),
    "sdpa-no-keys": lambda: torch.equal(scaled_dot_product_attention(*qkv(keys=0)), torch.zeros(2, 3, 6)),
    "mha-empty-sequence-reference": _mha_empty_sequence("reference"),
    "mha-empty-sequence-torch": _mha_empty_sequence("torch"),
    "mha-empty-sequence-blockwise": _mha_empty_sequence("blockwise"),
    "lm-every-integer-dtype-ids": _lm_every_integer_dtype,
    "rope-uint8-positions": _rope_uint8_positions,
    "rmsnorm-huge-input": _rmsnorm_huge_input,
    "lm-kv-step-interrupted": _lm_kv_step_interrupted,
    "lm-pickles": _lm_pickles,
}


@pytest.mark.parametrize("row", list(BEHAVES))
def test_documented_behaviour(row):
    result = BEHAVES[row]()
    assert result is None or result is True


# --------------------------------------------------------------------------------------- NaN inputs
# None of these raise: tlm never checks values for NaN (a data-dependent check on every call).
NAN = float("nan")


def with_nan(x: torch.Tensor, index: tuple) -> torch.Tensor:
    x = x.clone()
    x[index] = NAN
    return x


def nan_rows(y: torch.Tensor) -> list:
    """Which positions (all axes but the last) hold any NaN."""
    return torch.isnan(y).any(-1).tolist()


def _nan_elementwise(module, x_shape, index, expected_rows):
    def check():
        x = torch.randn(x_shape)
        assert nan_rows(module(with_nan(x, index))) == expected_rows

    return check


def _nan_rope():
    out = rope()(with_nan(torch.randn(3, 8), (1, 5)))
    # Only the pair (x[4], x[5]) of position 1 is NaN.
    assert torch.isnan(out).nonzero().tolist() == [[1, 4], [1, 5]]


def _nan_silu():
    assert torch.isnan(silu(with_nan(torch.randn(3, 4), (1, 2)))).nonzero().tolist() == [[1, 2]]


def _nan_softmax():
    out = softmax(with_nan(torch.randn(3, 4), (1, 2)), dim=-1)
    assert nan_rows(out) == [False, True, False] and torch.isnan(out[1]).all()


CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()


def _nan_sdpa(which: str, expected_rows: list):
    def check():
        q, k, v = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        q, k, v = (with_nan(t, (2, 0)) if name == which else t for name, t in zip("QKV", (q, k, v), strict=True))
        assert nan_rows(scaled_dot_product_attention(q, k, v, CAUSAL)) == expected_rows

    return check


def _nan_mha(backend: str):
    def check():
        torch.manual_seed(0)
        attn = mha(attention_backend=backend)
        x = torch.randn(2, 6, 16)
        clean = attn(x)
        out = attn(with_nan(x, (0, 3, 5)))  # batch row 0, position 3
        assert torch.equal(out[1], clean[1]), "the other batch row is untouched"
        assert nan_rows(out[0])[3:] == [True] * 3, "positions that attend to the NaN must be NaN"
        # Also the positions before it: their weight on key 3 is exactly 0, but 0·NaN = NaN (the
        # blockwise backend skips key blocks wholly in a query's future, but 6 tokens are one block).
        assert nan_rows(out[0])[:3] == [True] * 3

    return check


def _nan_lm(backend: str):
    def check():
        torch.manual_seed(0)
        model = lm(attention_backend=backend)
        tokens = torch.tensor([[1, 2, 4, 3, 5], [1, 2, 4, 4, 5]])
        clean = model(tokens)
        with torch.no_grad():
            model.token_embeddings.weight[3, 0] = NAN  # token 3 appears in row 0 only, at position 3
        out = model(tokens)
        assert torch.equal(out[1], clean[1]), "the other batch row is untouched"
        assert nan_rows(out[0])[3:] == [True] * 2, "positions that attend to the NaN must be NaN"
        assert nan_rows(out[0])[:3] == [True] * 3, "and, through 0·NaN in the first layer, those before it"

    return check


NANS = {
    "nan-linear": _nan_elementwise(Linear(4, 3), (3, 4), (1, 2), [False, True, False]),
    "nan-rmsnorm": _nan_elementwise(RMSNorm(4), (3, 4), (1, 2), [False, True, False]),
    "nan-swiglu": _nan_elementwise(SwiGLU(4, 8), (3, 4), (1, 2), [False, True, False]),
    "nan-rope": _nan_rope,
    "nan-silu": _nan_silu,
    "nan-softmax": _nan_softmax,
    # NaN at index 2 of Q, K or V, under a causal 4×4 mask.
    "nan-sdpa-query": _nan_sdpa("Q", [False, False, True, False]),
    "nan-sdpa-key": _nan_sdpa("K", [False, False, True, True]),
    "nan-sdpa-value": _nan_sdpa("V", [True, True, True, True]),
    "nan-mha-auto": _nan_mha("auto"),
    "nan-mha-reference": _nan_mha("reference"),
    "nan-mha-torch": _nan_mha("torch"),
    "nan-mha-blockwise": _nan_mha("blockwise"),
    "nan-lm-embedding": _nan_lm("auto"),
    "nan-lm-embedding-blockwise": _nan_lm("blockwise"),
}


@pytest.mark.parametrize("check", list(NANS.values()), ids=list(NANS))
def test_nan_propagates_without_raising(check):
    check()


# ------------------------------------------------------------------------- documentation in step


ERRORS_BEGIN = (
    "<!-- errors: generated from RAISES in packages/tlm-model/tests/test_bad_input.py "
    "(python packages/tlm-model/tests/test_bad_input.py); do not edit by hand -->\n"
)
ERRORS_END = "<!-- /errors -->\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def errors_table() -> str:
    """The docs' "Errors" table, one row per entry of RAISES: id, input, and the exception with its message."""
    lines = ["| id | input | what the user gets |", "|---|---|---|"]
    for row in RAISES:
        message = (row.message or _raised(row)).replace("\n", "\\n").replace("\t", "\\t")
        got = f"`{row.exception.__name__}: {message}`" + (f" {row.note}" if row.note else "")
        lines.append(f"| `{row.id}` | {_cell(row.input)} | {_cell(got)} |")
    return ERRORS_BEGIN + "\n".join(lines) + "\n" + ERRORS_END


def _with_errors_table(text: str) -> str:
    begin, end = text.index(ERRORS_BEGIN), text.index(ERRORS_END) + len(ERRORS_END)
    return text[:begin] + errors_table() + text[end:]


def documented_ids() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9_-]+)` \|", section, flags=re.MULTILINE)


@pytest.mark.skipif(not DOC.exists(), reason="docs/reliability.md lives in the tlm monorepo, not in this copy")
def test_the_errors_table_is_generated_from_raises():
    text = DOC.read_text(encoding="utf-8")
    assert text == _with_errors_table(text), "run python packages/tlm-model/tests/test_bad_input.py"


@pytest.mark.skipif(not DOC.exists(), reason="docs/reliability.md lives in the tlm monorepo, not in this copy")
def test_every_owner_is_a_test_file_and_every_row_has_one_message():
    for row in RAISES:
        assert bool(row.message) != bool(row.owner), row.id
        assert not row.owner or (DOC.parents[1] / "packages" / row.owner).is_file(), row.id


@pytest.mark.skipif(not DOC.exists(), reason="docs/reliability.md lives in the tlm monorepo, not in this copy")
def test_every_documented_row_is_a_test():
    tested = [row.id for row in RAISES] + list(BEHAVES) + list(NANS)
    documented = documented_ids()
    assert len(tested) == len(set(tested)), "duplicate ids"
    assert sorted(documented) == sorted(tested)


# ---------------------------------------------------------------------------- nothing changes in place


def _snapshot(tensors):
    return [(t, t.clone(), t._version) for t in tensors]


def _assert_unchanged(snapshot):
    for tensor, before, version in snapshot:
        # equal_nan: NaN inputs must stay NaN; _version counts every in-place write, even one that
        # happens to store the same values.
        assert torch.equal(tensor.isnan(), before.isnan()) and torch.equal(tensor.nan_to_num(), before.nan_to_num()), (
            "input values changed"
        )
        assert tensor._version == version, "input was written in place"


def _inplace_cases():
    x16 = torch.randn(2, 5, 16)
    positions = torch.arange(5)
    q, k, v = qkv()
    mask = torch.rand(3, 5) < 0.7
    tokens = ids(2, 5)
    return {
        "Linear": (Linear(16, 4), (x16,)),
        "Embedding": (Embedding(11, 4), (tokens,)),
        "RMSNorm": (RMSNorm(16), (with_nan(x16, (0, 0, 0)),)),
        "SwiGLU": (SwiGLU(16, 24), (x16,)),
        "silu": (silu, (x16,)),
        "RotaryPositionalEmbedding": (rope(16), (x16, positions)),
        "softmax": (lambda x: softmax(x, -1), (x16,)),
        "scaled_dot_product_attention": (scaled_dot_product_attention, (q, k, v, mask)),
        "CausalMultiHeadSelfAttention": (mha(), (x16, positions)),
        "CausalMultiHeadSelfAttention-reference": (mha(attention_backend="reference"), (x16, positions)),
        "CausalMultiHeadSelfAttention-blockwise": (mha(attention_backend="blockwise"), (x16, positions)),
        "CausalMultiHeadSelfAttention-fused": (mha(fused=True), (x16, positions)),
        "TransformerBlock": (block(), (x16, positions)),
        "TransformerLM": (lm(), (tokens, positions)),
        "TransformerLM-unfused": (lm(fused=False), (tokens, positions)),
    }


@pytest.mark.parametrize("name", list(_inplace_cases()))
def test_inputs_are_not_modified_in_place(name):
    fn, args = _inplace_cases()[name]
    snapshot = _snapshot(args)
    fn(*args)
    _assert_unchanged(snapshot)


@pytest.mark.parametrize("name", list(_inplace_cases()))
def test_inputs_that_require_grad_are_not_modified_by_backward(name):
    fn, args = _inplace_cases()[name]
    args = tuple(a.detach().requires_grad_(True) if a.is_floating_point() else a for a in args)
    snapshot = _snapshot(args)
    out = fn(*args)
    out.float().sum().backward()
    _assert_unchanged(snapshot)


def test_load_state_dict_leaves_the_callers_dict_alone():
    state = lm().state_dict()
    keys, snapshot = list(state), _snapshot(state.values())
    lm().load_state_dict(state)
    assert list(state) == keys
    _assert_unchanged(snapshot)


if __name__ == "__main__":  # regenerate docs/reliability.md's "Errors" table from RAISES
    DOC.write_text(_with_errors_table(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the errors table of {DOC}")

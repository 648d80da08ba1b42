"""tlm's own checks of the course adapters, against references that share no code with tlm.

Leaf adapters are compared with torch built-ins at float32 tolerance 1e-6; the block and the
LM with HF transformers' LlamaForCausalLM (the same architecture once q/k projection rows are
permuted from interleaved to rotate-half pairs) at 1e-4 relative. Calls use the course tests'
keyword names and shapes. Each comparison's largest error is printed in the terminal summary.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from tlm_model import ModelConfig
from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict

from . import adapters

TOL = dict(rtol=1e-6, atol=1e-6)
LM_TOL = dict(rtol=1e-4, atol=1e-5)

# The course's conftest sizes: batch 4, 12 queries, 16 keys, d_model 64, 4 heads, d_ff 128.
BATCH, N_QUERIES, N_KEYS, D_MODEL, N_HEADS, D_FF, THETA, VOCAB, N_LAYERS = 4, 12, 16, 64, 4, 128, 10_000.0, 10_000, 3

COURSE_SIGNATURES = {
    "run_linear": ["d_in", "d_out", "weights", "in_features"],
    "run_embedding": ["vocab_size", "d_model", "weights", "token_ids"],
    "run_swiglu": ["d_model", "d_ff", "w1_weight", "w2_weight", "w3_weight", "in_features"],
    "run_scaled_dot_product_attention": ["Q", "K", "V", "mask"],
    "run_multihead_self_attention": [
        "d_model", "num_heads", "q_proj_weight", "k_proj_weight", "v_proj_weight", "o_proj_weight", "in_features",
    ],
    "run_multihead_self_attention_with_rope": [
        "d_model", "num_heads", "max_seq_len", "theta", "q_proj_weight", "k_proj_weight", "v_proj_weight",
        "o_proj_weight", "in_features", "token_positions",
    ],
    "run_rope": ["d_k", "theta", "max_seq_len", "in_query_or_key", "token_positions"],
    "run_transformer_block": ["d_model", "num_heads", "d_ff", "max_seq_len", "theta", "weights", "in_features"],
    "run_transformer_lm": [
        "vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta", "weights",
        "in_indices",
    ],
    "run_rmsnorm": ["d_model", "eps", "weights", "in_features"],
    "run_silu": ["in_features"],
    "run_softmax": ["in_features", "dim"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COURSE_SIGNATURES))
def test_adapter_signatures_match_the_course(name):
    assert list(inspect.signature(getattr(adapters, name)).parameters) == COURSE_SIGNATURES[name]


def weight(*shape, scale=None):
    scale = (2 / sum(shape[-2:])) ** 0.5 if scale is None else scale
    return torch.randn(*shape) * scale


def lm_weights(vocab=VOCAB, d=D_MODEL, d_ff=D_FF, layers=N_LAYERS):
    sd = {"token_embeddings.weight": torch.randn(vocab, d), "ln_final.weight": torch.rand(d) + 0.5}
    sd["lm_head.weight"] = weight(vocab, d)
    for i in range(layers):
        for name in ("q", "k", "v", "output"):
            sd[f"layers.{i}.attn.{name}_proj.weight"] = weight(d, d)
        sd[f"layers.{i}.ffn.w1.weight"] = weight(d_ff, d)
        sd[f"layers.{i}.ffn.w3.weight"] = weight(d_ff, d)
        sd[f"layers.{i}.ffn.w2.weight"] = weight(d, d_ff)
        sd[f"layers.{i}.ln1.weight"] = torch.rand(d) + 0.5
        sd[f"layers.{i}.ln2.weight"] = torch.rand(d) + 0.5
    return sd


def block_weights(sd, layer=0):
    prefix = f"layers.{layer}."
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


@pytest.fixture
def in_embeddings():
    return torch.randn(BATCH, N_QUERIES, D_MODEL)


def test_run_linear(in_embeddings, record_error):
    w = weight(D_FF, D_MODEL)
    out = adapters.run_linear(d_in=D_MODEL, d_out=D_FF, weights=w, in_features=in_embeddings)
    expected = F.linear(in_embeddings, w)
    record_error("run_linear vs F.linear", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


def test_run_embedding(record_error):
    w = torch.randn(VOCAB, D_MODEL)
    ids = torch.randint(0, VOCAB, (BATCH, N_QUERIES))
    out = adapters.run_embedding(vocab_size=VOCAB, d_model=D_MODEL, weights=w, token_ids=ids)
    expected = F.embedding(ids, w)
    record_error("run_embedding vs F.embedding", out, expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_run_swiglu(in_embeddings, record_error):
    w1, w2, w3 = weight(D_FF, D_MODEL), weight(D_MODEL, D_FF), weight(D_FF, D_MODEL)
    out = adapters.run_swiglu(
        d_model=D_MODEL, d_ff=D_FF, w1_weight=w1, w2_weight=w2, w3_weight=w3, in_features=in_embeddings
    )
    expected = F.linear(F.silu(F.linear(in_embeddings, w1)) * F.linear(in_embeddings, w3), w2)
    record_error("run_swiglu vs F.linear/F.silu", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


def test_run_silu(record_error):
    x = torch.randn(5, 7) * 4
    out = adapters.run_silu(x)
    record_error("run_silu vs F.silu", out, F.silu(x))
    torch.testing.assert_close(out, F.silu(x), **TOL)


def test_run_rmsnorm(in_embeddings, record_error):
    w = torch.rand(D_MODEL) + 0.5
    out = adapters.run_rmsnorm(d_model=D_MODEL, eps=1e-5, weights=w, in_features=in_embeddings)
    expected = F.rms_norm(in_embeddings, (D_MODEL,), w, eps=1e-5)
    record_error("run_rmsnorm vs F.rms_norm", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("shift", [0.0, 100.0])
def test_run_softmax(dim, shift, record_error):
    x = torch.randn(3, 5, 7) + shift
    out = adapters.run_softmax(x, dim=dim)
    record_error("run_softmax vs F.softmax", out, F.softmax(x, dim=dim))
    torch.testing.assert_close(out, F.softmax(x, dim=dim), **TOL)


def test_run_rope(in_embeddings, rope_reference, record_error):
    positions = torch.arange(N_QUERIES)
    out = adapters.run_rope(
        D_MODEL, theta=THETA, max_seq_len=N_QUERIES, in_query_or_key=in_embeddings, token_positions=positions
    )
    expected = rope_reference(in_embeddings, positions, THETA)
    record_error("run_rope vs complex multiplication (float64)", out, expected)
    torch.testing.assert_close(out.double(), expected, **TOL)


@pytest.mark.parametrize("four_d", [False, True])
def test_run_scaled_dot_product_attention(four_d, record_error):
    q, k, v = torch.randn(8, N_QUERIES, 16), torch.randn(8, N_KEYS, 16), torch.randn(8, N_KEYS, 16)
    mask = torch.rand(8, N_QUERIES, N_KEYS) > 0.5
    mask[..., 0] = True  # torch's SDPA returns NaN for fully masked rows; tlm returns zeros (tested elsewhere)
    if four_d:
        q, k, v, mask = (t.unflatten(0, (4, 2)) for t in (q, k, v, mask))
    out = adapters.run_scaled_dot_product_attention(Q=q, K=k, V=v, mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    record_error("run_scaled_dot_product_attention vs F.sdpa", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


def builtin_mha(x, wq, wk, wv, wo, heads, rotate=None):
    def split(t):
        return t.unflatten(-1, (heads, -1)).transpose(-2, -3)

    q, k, v = split(F.linear(x, wq)), split(F.linear(x, wk)), split(F.linear(x, wv))
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(-2, -3).flatten(-2), wo)


def test_run_multihead_self_attention(in_embeddings, record_error):
    ws = [weight(D_MODEL, D_MODEL) for _ in range(4)]
    out = adapters.run_multihead_self_attention(
        d_model=D_MODEL,
        num_heads=N_HEADS,
        q_proj_weight=ws[0],
        k_proj_weight=ws[1],
        v_proj_weight=ws[2],
        o_proj_weight=ws[3],
        in_features=in_embeddings,
    )
    expected = builtin_mha(in_embeddings, *ws, N_HEADS)
    record_error("run_multihead_self_attention vs F.linear/F.sdpa", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("positions_shape", ["course (1, seq)", "none", "per batch row"])
def test_run_multihead_self_attention_with_rope(in_embeddings, positions_shape, rope_reference, record_error):
    ws = [weight(D_MODEL, D_MODEL) for _ in range(4)]
    positions = {
        "course (1, seq)": torch.arange(N_QUERIES).unsqueeze(0),
        "none": None,
        "per batch row": torch.randint(0, N_KEYS, (BATCH, N_QUERIES)),
    }[positions_shape]
    out = adapters.run_multihead_self_attention_with_rope(
        d_model=D_MODEL,
        num_heads=N_HEADS,
        max_seq_len=N_KEYS,
        theta=THETA,
        q_proj_weight=ws[0],
        k_proj_weight=ws[1],
        v_proj_weight=ws[2],
        o_proj_weight=ws[3],
        in_features=in_embeddings,
        token_positions=positions,
    )
    ref_positions = torch.arange(N_QUERIES) if positions is None else positions.unsqueeze(-2)  # over heads

    def rotate(t):
        return rope_reference(t, ref_positions, THETA).float()

    expected = builtin_mha(in_embeddings, *ws, N_HEADS, rotate)
    record_error("run_multihead_self_attention_with_rope vs F.sdpa + complex RoPE", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


# --- Block and LM against HF transformers' Llama ------------------------------------------------


def hf_llama(sd, vocab, context, d, layers, heads, d_ff, theta):
    """HF's LlamaForCausalLM holding ``sd``. The conversion only reorders q/k rows and renames keys,
    so a mistake in it shows up as a mismatch, never as a false agreement."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is the block/LM reference")
    cfg = ModelConfig(vocab, context, d, layers, heads, d_ff, theta)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config_kwargs(cfg))).eval()
    model.load_state_dict(to_hf_llama_state_dict(sd, cfg), strict=True)
    return model


@pytest.mark.parametrize("seq", [N_QUERIES, N_QUERIES // 2, N_KEYS])
def test_run_transformer_lm_matches_hf_llama(seq, record_error):
    sd = lm_weights()
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    out = adapters.run_transformer_lm(
        vocab_size=VOCAB,
        context_length=N_KEYS,
        d_model=D_MODEL,
        num_layers=N_LAYERS,
        num_heads=N_HEADS,
        d_ff=D_FF,
        rope_theta=THETA,
        weights=sd,
        in_indices=ids,
    )
    reference = hf_llama(sd, VOCAB, N_KEYS, D_MODEL, N_LAYERS, N_HEADS, D_FF, THETA)
    with torch.no_grad():
        expected = reference(ids).logits
    record_error("run_transformer_lm vs HF LlamaForCausalLM", out, expected)
    torch.testing.assert_close(out, expected, **LM_TOL)


def test_run_transformer_block_matches_one_layer_hf_llama(in_embeddings, record_error):
    # A one-layer Llama fed our input through inputs_embeds, with the final norm and head
    # swapped for identities, computes exactly one decoder layer.
    sd = lm_weights(layers=1)
    out = adapters.run_transformer_block(
        d_model=D_MODEL,
        num_heads=N_HEADS,
        d_ff=D_FF,
        max_seq_len=N_KEYS,
        theta=THETA,
        weights=block_weights(sd),
        in_features=in_embeddings,
    )
    reference = hf_llama(sd, VOCAB, N_KEYS, D_MODEL, 1, N_HEADS, D_FF, THETA)
    reference.model.norm = torch.nn.Identity()
    with torch.no_grad():
        expected = reference.model(inputs_embeds=in_embeddings).last_hidden_state
    record_error("run_transformer_block vs HF Llama decoder layer", out, expected)
    torch.testing.assert_close(out, expected, **TOL)


def test_lm_loads_course_checkpoint_with_compiled_prefix():
    sd = lm_weights(vocab=50, layers=2)
    ids = torch.randint(0, 50, (2, 8))
    kwargs = dict(
        vocab_size=50, context_length=N_KEYS, d_model=D_MODEL, num_layers=2, num_heads=N_HEADS, d_ff=D_FF,
        rope_theta=THETA, in_indices=ids,
    )  # fmt: skip
    plain = adapters.run_transformer_lm(weights=sd, **kwargs)
    prefixed = adapters.run_transformer_lm(weights={f"_orig_mod.{k}": v for k, v in sd.items()}, **kwargs)
    torch.testing.assert_close(prefixed, plain, rtol=0, atol=0)


def test_adapters_use_tlm_code_not_torch_builtins(monkeypatch, in_embeddings):
    def forbidden(*args, **kwargs):
        raise AssertionError("a course adapter reached a torch built-in the course asks us to write")

    for name in ("linear", "embedding", "scaled_dot_product_attention", "rms_norm", "silu", "softmax"):
        monkeypatch.setattr(F, name, forbidden)
    monkeypatch.setattr(torch, "softmax", forbidden)
    sd = lm_weights(vocab=50, layers=1)
    ws = [sd[f"layers.0.attn.{n}_proj.weight"] for n in ("q", "k", "v", "output")]
    adapters.run_linear(d_in=D_MODEL, d_out=D_MODEL, weights=ws[0], in_features=in_embeddings)
    adapters.run_embedding(vocab_size=50, d_model=D_MODEL, weights=sd["token_embeddings.weight"],
                           token_ids=torch.tensor([1, 2]))  # fmt: skip
    adapters.run_silu(in_embeddings)
    adapters.run_softmax(in_embeddings, dim=-1)
    adapters.run_rmsnorm(d_model=D_MODEL, eps=1e-5, weights=sd["ln_final.weight"], in_features=in_embeddings)
    adapters.run_rope(D_MODEL, theta=THETA, max_seq_len=N_QUERIES, in_query_or_key=in_embeddings,
                      token_positions=torch.arange(N_QUERIES))  # fmt: skip
    adapters.run_scaled_dot_product_attention(Q=in_embeddings, K=in_embeddings, V=in_embeddings)
    adapters.run_multihead_self_attention(D_MODEL, N_HEADS, *ws, in_features=in_embeddings)
    adapters.run_multihead_self_attention_with_rope(D_MODEL, N_HEADS, N_KEYS, THETA, *ws, in_features=in_embeddings)
    adapters.run_transformer_block(D_MODEL, N_HEADS, D_FF, N_KEYS, THETA, block_weights(sd), in_embeddings)
    adapters.run_transformer_lm(50, N_KEYS, D_MODEL, 1, N_HEADS, D_FF, THETA, sd, torch.randint(0, 50, (2, 5)))

"""Fixtures for tlm-model's tests: float64 re-derivations of the block and the LM, and ``built``, a spy on
every TransformerLM a test builds.

The re-derivations import nothing of tlm: projections are F.linear, norms F.rms_norm, attention
F.scaled_dot_product_attention, and RoPE the complex-multiplication reference of the root
conftest.py. Test modules import the process harness in fault_processes.py beside this file, so the
folder goes on sys.path (pytest runs in importlib mode).
"""

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def reference_block(
    sd, x, heads, theta, rope_reference, positions=None, eps=1e-5, norm_placement="pre", rope=True, ffn="swiglu"
):
    """The block re-derived in float64 from torch built-ins and the complex-number RoPE: pre-norm
    x + f(norm(x)), post-norm norm(x + f(x)) or no norm x + f(x); RoPE or none; SwiGLU or the SiLU FFN."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    seq = x.shape[-2]
    positions = torch.arange(seq, device=x.device) if positions is None else positions

    def split(t):
        return t.unflatten(-1, (heads, -1)).transpose(-2, -3)

    def norm(h, name):
        return h if norm_placement == "none" else F.rms_norm(h, (h.shape[-1],), sd[name], eps)

    def attention(h):
        q, k, v = (split(F.linear(h, sd[f"attn.{n}_proj.weight"])) for n in "qkv")
        if rope:
            q, k = rope_reference(q, positions, theta), rope_reference(k, positions, theta)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(-2, -3).flatten(-2)
        return F.linear(out, sd["attn.output_proj.weight"])

    def feed_forward(h):
        hidden = F.silu(F.linear(h, sd["ffn.w1.weight"]))
        if ffn == "swiglu":
            hidden = hidden * F.linear(h, sd["ffn.w3.weight"])
        return F.linear(hidden, sd["ffn.w2.weight"])

    if norm_placement == "post":
        y = norm(x + attention(x), "ln1.weight")
        return norm(y + feed_forward(y), "ln2.weight")
    y = x + attention(norm(x, "ln1.weight"))
    return y + feed_forward(norm(y, "ln2.weight"))


def reference_lm(sd, ids, cfg, rope_reference, positions=None):
    """TransformerLM's logits from its state dict ``sd`` and config ``cfg``, in float64."""
    x = sd["token_embeddings.weight"].double()[ids]
    variant = dict(norm_placement=cfg.norm_placement, rope=cfg.positions == "rope", ffn=cfg.ffn)
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        block_sd = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        x = reference_block(
            block_sd, x, cfg.num_heads, cfg.rope_theta, rope_reference, positions, cfg.norm_eps, **variant
        )
    if cfg.norm_placement != "none":
        x = F.rms_norm(x, (cfg.d_model,), sd["ln_final.weight"].double(), cfg.norm_eps)
    return F.linear(x, sd["lm_head.weight"].double())


@pytest.fixture
def block_reference(rope_reference):
    """``block_reference(state_dict, x, heads, theta, positions=None, eps=1e-5, **variant)`` in float64; the
    variant keywords are ``norm_placement``, ``rope`` (a bool) and ``ffn``."""

    def run(sd, x, heads, theta, positions=None, eps=1e-5, **variant):
        return reference_block(sd, x, heads, theta, rope_reference, positions, eps, **variant)

    return run


@pytest.fixture
def lm_reference(rope_reference):
    """``lm_reference(state_dict, ids, config, positions=None)``: logits in float64."""

    def run(sd, ids, cfg, positions=None):
        return reference_lm(sd, ids, cfg, rope_reference, positions)

    return run


COURSE_BLOCK_KEYS = (
    "attn.q_proj.weight",
    "attn.k_proj.weight",
    "attn.v_proj.weight",
    "attn.output_proj.weight",
    "ln1.weight",
    "ffn.w1.weight",
    "ffn.w2.weight",
    "ffn.w3.weight",
    "ln2.weight",
)


@pytest.fixture
def course_block_keys():
    """The state-dict keys of a block in the course's layout."""
    return set(COURSE_BLOCK_KEYS)


@pytest.fixture
def course_lm_keys():
    """``course_lm_keys(num_layers)``: the state-dict keys of a TransformerLM in the course's layout."""

    def keys(num_layers):
        top = {"token_embeddings.weight", "ln_final.weight", "lm_head.weight"}
        return top | {f"layers.{i}.{key}" for i in range(num_layers) for key in COURSE_BLOCK_KEYS}

    return keys


@pytest.fixture
def built(monkeypatch):
    """The (num_layers, kwargs) of every TransformerLM built while the test runs."""
    from tlm_model import TransformerLM

    calls, original = [], TransformerLM.__init__

    def spy(self, config, **kwargs):
        calls.append((config.num_layers, kwargs))
        original(self, config, **kwargs)

    monkeypatch.setattr(TransformerLM, "__init__", spy)
    return calls

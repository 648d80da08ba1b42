"""LoRALinear and apply_lora against independent references: HF peft's LoRA on the HF Llama export of the
same weights (logits and adapter gradients), the base model itself (B = 0), and the merged weights."""

import pytest
import torch

from tlm_linear import Linear
from tlm_lora import (
    LoRALinear,
    apply_lora,
    base_state_dict,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    merged_state_dict,
    unmerge_lora,
    weights_sha256,
)
from tlm_model import ModelConfig, TransformerLM

ALL = ("q", "k", "v", "o", "w1", "w2", "w3", "lm_head")
# GQA (4 query heads, 2 key/value heads), an untied head so that lm_head can be adapted.
CONFIG = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)


def base_model(fused=True, config=CONFIG, seed=0):
    torch.manual_seed(seed)
    model = TransformerLM(config, fused=fused)
    with torch.no_grad():  # gains away from 1, so the mapping of every weight is exercised
        for name, p in model.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    return model


def randomise_adapters(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in model.named_modules():
            if isinstance(module, LoRALinear):
                for b in module.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=generator) * 0.1)


def ids(n=2, seq=12, seed=3):
    return torch.randint(0, CONFIG.vocab_size, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fused", [True, False])
def test_b_zero_at_start_gives_exactly_the_base_model(fused):
    model = base_model(fused)
    x = ids()
    with torch.no_grad():
        before = model(x)
    apply_lora(model, ALL, rank=4, alpha=8)
    with torch.no_grad():
        after = model(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_fused_layers_keep_one_base_weight_and_match_the_unfused_model():
    fused, unfused = base_model(True), base_model(False)
    unfused.load_state_dict(fused.state_dict())  # the same base (the two layouts draw differently)
    adapted = apply_lora(fused, "q,v,w1,w3", rank=4)
    apply_lora(unfused, ["q", "v", "w1", "w3"], rank=4)
    attn = fused.layers[0].attn
    assert isinstance(attn.qkv_proj, LoRALinear) and list(attn.qkv_proj.rows) == ["q_proj", "v_proj"]
    assert attn.qkv_proj.rows["v_proj"] == (48, 64)  # q: 4 heads x 8, k: 2 x 8, then v
    assert attn.qkv_proj.weight.shape == (64, 32)  # the fused base weight, not unfused
    assert adapted[:4] == ["layers.0.attn.q_proj", "layers.0.attn.v_proj", "layers.0.ffn.w1", "layers.0.ffn.w3"]
    randomise_adapters(fused)
    adapters = lora_state_dict(fused)
    assert set(adapters) == set(lora_state_dict(unfused))
    load_lora_state_dict(unfused, adapters)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), unfused(x), rtol=1e-5, atol=1e-5)
    # The base's state-dict keys are unchanged by the wrapping (a fused weight still splits on save).
    assert set(base_state_dict(fused)) == set(TransformerLM(CONFIG).state_dict())


@pytest.mark.parametrize("fused", [True, False])
def test_merge_equals_the_unmerged_forward_and_unmerge_restores_it(fused):
    model = base_model(fused)
    apply_lora(model, ALL, rank=4, alpha=16)
    randomise_adapters(model)
    x = ids()
    base = {k: v.clone() for k, v in base_state_dict(model).items()}
    with torch.no_grad():
        unmerged = model(x)
        plain = TransformerLM(CONFIG)
        plain.load_state_dict(merged_state_dict(model))
        merge_lora(model)
        merged = model(x)
        from_merged_weights = plain(x)
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_merged_weights, unmerged, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="merged adapters"):
        base_state_dict(model)
    unmerge_lora(model)
    for key, value in base_state_dict(model).items():
        torch.testing.assert_close(value, base[key], rtol=1e-6, atol=1e-6)


def _peft_pair(fused):
    """(tlm model with adapters, peft model of its HF export with the same adapters), float32."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tlm_model.interop import hf_llama_config_kwargs, to_hf_llama_state_dict, to_hf_lora_state_dict

    model = base_model(fused)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config_kwargs(CONFIG)))
    hf.load_state_dict(to_hf_llama_state_dict(model.state_dict(), CONFIG))
    apply_lora(model, ALL, rank=4, alpha=12)
    randomise_adapters(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    lora = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, target_modules=targets)
    wrapped = peft.get_peft_model(hf, lora)
    result = peft.set_peft_model_state_dict(wrapped, to_hf_lora_state_dict(lora_state_dict(model), CONFIG))
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    return model, wrapped


def rel_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.slow  # importing peft and transformers: ~5 s on the 2-core machine
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("fused", [True, False])
def test_peft_on_the_hf_export_gives_the_same_logits_and_adapter_gradients(fused, record_error):
    from tlm_model.interop import from_hf_lora_state_dict

    model, wrapped = _peft_pair(fused)
    x, targets = ids(), ids(seed=4)
    logits, ref = model(x), wrapped(input_ids=x).logits
    record_error(f"LoRA logits vs peft ({'fused' if fused else 'unfused'})", logits, ref)
    assert rel_err(logits, ref) < 1e-5, rel_err(logits, ref)
    # Gradients of the training loss: tlm's chunked loss (the LoRA head through loss_operands) against
    # torch's cross-entropy on peft's logits.
    model.loss(x, targets).backward()
    torch.nn.functional.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    peft_grads = {
        n.replace(".default.weight", ".weight"): p.grad for n, p in wrapped.named_parameters() if p.requires_grad
    }
    theirs = from_hf_lora_state_dict(peft_grads, CONFIG)
    ours = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):  # the gradients in lora_state_dict's keys
            for name in module.rows:
                parent = path.rsplit(".", 1)[0]
                key = path if name == "default" else f"{parent}.{name}"
                ours[f"{key}.lora_A.weight"] = module.lora_A[name].grad
                ours[f"{key}.lora_B.weight"] = module.lora_B[name].grad
    assert set(ours) == set(theirs) and len(ours) == 2 * (7 * CONFIG.num_layers + 1)
    for key in ours:
        record_error(f"LoRA adapter gradients vs peft ({'fused' if fused else 'unfused'})", ours[key], theirs[key])
    worst = max(rel_err(ours[k], theirs[k]) for k in ours)
    assert worst < 1e-5, worst


def test_the_head_adapter_trains_through_the_chunked_loss_with_dropout_on_its_path():
    model = base_model()
    apply_lora(model, ["lm_head"], rank=2, dropout=0.5)
    randomise_adapters(model)
    head = model.lm_head
    x, targets = ids(), ids(seed=4)
    model.eval()  # dropout off: the loss equals cross-entropy of forward's logits
    ref = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model.loss(x, targets), ref, rtol=1e-6, atol=1e-6)
    model.train()
    torch.manual_seed(5)
    loss = model.loss(x, targets)
    torch.manual_seed(5)  # the same dropout mask, drawn by forward on the same hidden states
    hidden = model.hidden_states(x).flatten(0, 1)
    manual = torch.nn.functional.cross_entropy(head(hidden), targets.flatten())
    torch.testing.assert_close(loss, manual, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert head.lora_A["default"].grad.abs().sum() > 0 and head.weight.grad is None


def test_refusals_name_the_problem_and_leave_the_model_unwrapped():
    model = base_model()
    with pytest.raises(ValueError, match=r"unknown roles \['x'\]"):
        apply_lora(model, "q,x")
    with pytest.raises(ValueError, match="rank must be"):
        apply_lora(model, "q", rank=0)
    with pytest.raises(ValueError, match="dropout must be"):
        apply_lora(model, "q", dropout=1.0)
    assert all(p.requires_grad for p in model.parameters())  # nothing was frozen by a refused call
    apply_lora(model, "q")
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, "v")
    tied = base_model(config=ModelConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tied to"):
        apply_lora(tied, "lm_head")
    silu = base_model(config=ModelConfig(**{**CONFIG.to_dict(), "ffn": "silu", "d_ff": 64}))
    with pytest.raises(ValueError, match=r"targets \['w3'\] match no"):
        apply_lora(silu, "w1,w3")
    with pytest.raises(TypeError, match="tlm_linear.Linear"):
        LoRALinear(torch.nn.Identity(), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not overlap"):
        LoRALinear(Linear(4, 6), 2, rows={"a": (0, 4), "b": (3, 6)})


def test_adapters_that_do_not_fit_are_refused_whole():
    model = base_model()
    apply_lora(model, "q,v", rank=4)
    saved = {k: v.clone() for k, v in lora_state_dict(model).items()}
    other = base_model()
    apply_lora(other, "q,v", rank=2)
    with pytest.raises(ValueError, match="do not fit"):
        load_lora_state_dict(model, lora_state_dict(other))
    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(model, {k: v for k, v in saved.items() if "layers.1" not in k})
    assert all(torch.equal(v, saved[k]) for k, v in lora_state_dict(model).items())


def test_weights_sha256_tells_bases_apart_and_ignores_the_file_layout():
    fused, unfused = base_model(True), base_model(False)
    unfused.load_state_dict(fused.state_dict())
    assert weights_sha256(fused.state_dict()) == weights_sha256(unfused.state_dict())
    assert weights_sha256(fused.state_dict()) != weights_sha256(base_model(seed=1).state_dict())


@pytest.mark.parametrize("fused", [True, False])
def test_a_bfloat16_frozen_base_gives_bfloat16_autocasts_exact_loss_and_adapter_gradients(fused):
    # Issue 42: under bfloat16 autocast every frozen float32 weight was cast to bfloat16 on each forward; held in
    # bfloat16, the products are the same ones (autocast's cast is the same round-to-nearest), at half the memory.
    from tlm_lora import cast_frozen_weights

    models = []
    for cast in (False, True):
        model = base_model(fused)
        apply_lora(model, ALL, rank=4, alpha=8)
        randomise_adapters(model)
        if cast:
            names = cast_frozen_weights(model, torch.bfloat16)
            assert names and all(model.get_parameter(n).dtype == torch.bfloat16 for n in names)
        models.append(model)
    float32_base, bfloat16_base = models
    dtypes = {n: p.dtype for n, p in bfloat16_base.named_parameters()}
    assert all(dtypes[n] == torch.float32 for n, p in bfloat16_base.named_parameters() if p.requires_grad)
    assert [d for n, d in dtypes.items() if "embed" in n] == [torch.float32]  # a lookup: autocast casts nothing
    assert all(d == torch.float32 for n, d in dtypes.items() if "ln" in n)  # gains are not matmul weights
    losses = []
    for model in models:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(ids(), ids(seed=4))
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(lora_state_dict(float32_base).items(), lora_state_dict(bfloat16_base).values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    grads = [[p.grad for p in m.parameters() if p.requires_grad] for m in models]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_cast_frozen_weights_keeps_a_head_tied_to_the_embedding_and_returns_what_it_cast():
    # A tied head's weight is the embedding's table too: a lookup that autocast never casts, so it stays float32.
    from dataclasses import replace

    from tlm_lora import cast_frozen_weights

    model = base_model(config=replace(CONFIG, tie_word_embeddings=True))
    apply_lora(model, ("q", "v"), rank=2, alpha=4)
    assert model.lm_head.weight is model.token_embeddings.weight
    model.layers[0].ffn.w2.weight.requires_grad_(True)  # trained: kept in float32 for its optimizer
    names = cast_frozen_weights(model, torch.bfloat16)
    assert "lm_head.weight" not in names and model.lm_head.weight.dtype == torch.float32
    assert "layers.0.ffn.w2.weight" not in names and model.layers[0].ffn.w2.weight.dtype == torch.float32
    cast = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert set(names) == cast and {"layers.0.attn.qkv_proj.weight", "layers.1.ffn.w2.weight"} <= cast
    assert cast_frozen_weights(model, torch.bfloat16) == []  # already in the dtype: nothing more to cast


def test_cast_frozen_weights_casts_parameters_only_and_leaves_a_weight_held_as_a_buffer():
    # Only a Parameter is a stored weight to cast (and counted for sharing); a Linear whose weight was swapped for
    # a buffer (a fixed projection, say) is not its concern and is left as it is.
    from tlm_lora import cast_frozen_weights

    model = torch.nn.Sequential(Linear(4, 4), Linear(4, 4))
    model[0].requires_grad_(False)
    table = model[1].weight.detach().clone()
    del model[1].weight
    model[1].register_buffer("weight", table)
    assert cast_frozen_weights(model, torch.bfloat16) == ["0.weight"]
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32

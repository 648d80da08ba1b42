import contextlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tlm_model import ModelConfig, TransformerLM, chunked_cross_entropy

SMALL = ModelConfig(vocab_size=211, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)


@pytest.mark.parametrize("chunk_size", [1, 7, 48, 4096])
def test_chunked_cross_entropy_matches_f_cross_entropy(chunk_size):
    hidden = torch.randn(48, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (48,))
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size)
    expected = F.cross_entropy(hidden @ weight.T, targets)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(3.0 * got, (hidden, weight))
    expected_grads = torch.autograd.grad(3.0 * expected, (hidden, weight))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    hidden = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 1, 1, 2])
    assert torch.autograd.gradcheck(lambda h, w: chunked_cross_entropy(h, w, targets, 2), (hidden, weight))


def test_model_loss_matches_full_logits(device):
    model = TransformerLM(SMALL, device=device)
    ids = torch.randint(0, SMALL.vocab_size, (3, 16), device=device)
    targets = torch.randint(0, SMALL.vocab_size, (3, 16), device=device)
    loss = model.loss(ids, targets, chunk_size=10)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    reference = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    expected = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_no_gradient_needed():
    model = TransformerLM(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (1, 8))
    with torch.no_grad():
        loss = model.loss(ids, ids)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_bad_arguments_are_refused_by_chunked_cross_entropy():
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"targets must have shape \(3,\), got \(2,\)"):
        chunked_cross_entropy(hidden, weight, torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"gather\(\): Expected dtype int32/int64 for index"):
        chunked_cross_entropy(hidden, weight, torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        chunked_cross_entropy(hidden, weight, torch.zeros(3, dtype=torch.long), chunk_size=0)


# gather's kernel refuses a target outside [0, vocab), negative ones included, without reading a value back to
# the host (a uint16 target past the vocabulary: test_bad_input's loss-uint16-targets-too-large).
@pytest.mark.parametrize("targets", [[-1, 3], [0, 10]])
def test_targets_outside_the_vocabulary_are_refused(targets):
    with pytest.raises(RuntimeError, match=r"index -?\d+ is out of bounds for dimension 1 with size 10"):
        chunked_cross_entropy(torch.randn(2, 6), torch.randn(10, 6), torch.tensor(targets))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.int32])
def test_targets_of_any_integer_dtype(dtype):
    hidden = torch.randn(12, 8, dtype=torch.float64)
    weight = torch.randn(30, 8, dtype=torch.float64)
    targets = torch.randint(0, 30, (12,))
    expected = F.cross_entropy(hidden @ weight.T, targets)
    torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets.to(dtype), 5), expected)


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("bad", [[-1] + [0] * 11, [30] + [0] * 11])
def test_out_of_range_targets_are_refused_under_torch_compile(bad):
    torch._dynamo.reset()
    compiled = torch.compile(chunked_cross_entropy, backend="aot_eager")
    hidden, weight = torch.randn(12, 8), torch.randn(30, 8)
    compiled(hidden, weight, torch.zeros(12, dtype=torch.long), 5)
    with pytest.raises(RuntimeError, match=r"index -?\d+ is out of bounds for dimension 1 with size 30"):
        compiled(hidden, weight, torch.tensor(bad), 5)
    torch._dynamo.reset()


class _Outputs(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inputs_without_grad"])
def test_evaluation_computes_the_loss_only(mode):
    # 40 tokens, d_model 12, vocab 30: the logits GEMMs are 2·40·12·30 FLOPs; the two gradient GEMMs
    # a training forward adds would triple that, and build (40, 12) and (30, 12) gradient buffers.
    requires_grad = mode != "inputs_without_grad"
    hidden = torch.randn(40, 12, dtype=torch.float64, requires_grad=requires_grad)
    weight = torch.randn(30, 12, dtype=torch.float64, requires_grad=requires_grad)
    targets = torch.randint(0, 30, (40,))
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    with context(), FlopCounterMode(display=False) as flops, _Outputs() as outputs:
        loss = chunked_cross_entropy(hidden, weight, targets, 16)
    assert flops.get_total_flops() == 2 * 40 * 12 * 30
    assert (40, 12) not in outputs.shapes and (30, 12) not in outputs.shapes  # no gradient buffers
    assert loss.grad_fn is None
    expected = F.cross_entropy(hidden.detach() @ weight.detach().T, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


def test_training_forward_still_builds_both_gradients():
    # The counterpart of the test above: with gradients wanted, the forward pass runs all three GEMMs.
    hidden = torch.randn(40, 12, requires_grad=True)
    weight = torch.randn(30, 12, requires_grad=True)
    with FlopCounterMode(display=False) as flops, _Outputs() as outputs:
        chunked_cross_entropy(hidden, weight, torch.randint(0, 30, (40,)), 16)
    # At least the logits GEMM and d loss/d hidden's (FlopCounterMode does not count the in-place addmm_
    # that accumulates the head's gradient).
    assert flops.get_total_flops() >= 2 * 2 * 40 * 12 * 30
    assert (40, 12) in outputs.shapes and (30, 12) in outputs.shapes


def test_model_evaluation_loss_equals_float64_cross_entropy():
    model = TransformerLM(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (3, 16))
    targets = torch.randint(0, SMALL.vocab_size, (3, 16))
    with torch.no_grad():
        loss = model.loss(ids, targets, chunk_size=10)
        logits = model(ids).double()
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert all(p.grad is None for p in model.parameters())


# ---- chunked_cross_entropy edges that a mutation run found unpinned: gradients wanted for one input


@pytest.mark.parametrize("wants", ["hidden", "weight"])
def test_gradient_for_one_input_only(wants):
    hidden = torch.randn(10, 6, dtype=torch.float64, requires_grad=wants == "hidden")
    weight = torch.randn(7, 6, dtype=torch.float64, requires_grad=wants == "weight")
    targets = torch.randint(0, 7, (10,))
    leaf = hidden if wants == "hidden" else weight
    (got,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 3), leaf)
    (expected,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, targets), leaf)
    torch.testing.assert_close(got, expected)


def test_bfloat16_inputs_are_reduced_in_float32():
    hidden = torch.randn(16, 32).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(50, 32).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (16,))
    loss = chunked_cross_entropy(hidden, weight, targets, 5)
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.cross_entropy(h32 @ w32.T, targets)
    expected.backward()
    assert loss.dtype == torch.bfloat16 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    # The float32 loss rounded once to bfloat16 (8 bits): within one bfloat16 step of the reference.
    torch.testing.assert_close(loss.float(), expected.detach(), rtol=2**-8, atol=0)
    # Gradients: d loss/d logits is rounded to bfloat16 (unit roundoff 2^-9) before its matmuls and
    # the result once more; normwise that is a few roundoffs, far below what a float32-free path loses.
    for got, want in ((hidden.grad, h32.grad), (weight.grad, w32.grad)):
        assert (got.float() - want).norm() <= 2**-6 * want.norm()


def test_mismatched_widths_are_a_value_error():
    with pytest.raises(ValueError, match=r"hidden must be \(tokens, d_model\) and weight \(vocab, d_model\)"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long))


class _GemmDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product and attention kernel run inside the block."""

    GEMMS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "dot", "addbmm"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in self.GEMMS or "scaled_dot_product" in name:
            # Attention's operands are (batch, heads, seq, head_dim); its float32 log-sum-exp (3-D) is no operand.
            rank = 4 if "scaled_dot_product" in name else 2
            leaves = pytree.tree_leaves((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= rank]
            self.calls.append((name, {t.dtype for t in tensors if t.is_floating_point()}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_under_autocast_every_gemm_of_loss_and_backward_runs_in_bfloat16(chunk_size):
    # The census: the model's projections, attention, and the chunked head's three GEMMs (logits, d hidden,
    # d head) of the forward and the backward, all in bfloat16; the loss itself reduced in float32.
    model = TransformerLM(SMALL, fused=False)
    ids = torch.randint(0, SMALL.vocab_size, (2, 16))
    with _GemmDtypes() as census, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(ids, ids.roll(1, 1), chunk_size=chunk_size)
        loss.backward()
    names = {name for name, _ in census.calls}
    assert "mm" in names and any("scaled_dot_product" in n for n in names)
    assert [call for call in census.calls if call[1] != {torch.bfloat16}] == []
    assert loss.dtype == torch.float32


def test_autocast_head_gradients_match_autograd_through_autocast():
    # The reference: full logits under the same autocast (a bfloat16 GEMM) and F.cross_entropy in float32, its
    # gradients by autograd (whose GEMMs autocast also runs in bfloat16). Both round d loss/d logits to bfloat16
    # once before each gradient GEMM, so they agree to a few bfloat16 roundoffs (2^-9) normwise.
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    targets = torch.randint(0, 50, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(hidden, weight, targets, 16)
        expected = F.cross_entropy((hidden @ weight.T).float(), targets)
    grads = torch.autograd.grad(got, (hidden, weight))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # the same bfloat16 logits, reduced in float32
    for g, e in zip(grads, expected_grads, strict=True):
        assert g.dtype == torch.float32 and (g - e).norm() <= 2**-7 * e.norm()


def test_the_default_chunk_is_256_tokens_on_a_cpu_and_larger_on_an_accelerator():
    from tlm_model.loss import default_chunk_size

    assert default_chunk_size("cpu", 50_257) == 256
    assert default_chunk_size("cuda", 50_257) == 2048  # 2048 x 50,257 logits: 412 M bytes in float32
    assert default_chunk_size("cuda", 10_000) == 8192
    assert default_chunk_size("cuda", 256_000) == 1024

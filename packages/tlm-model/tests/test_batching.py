"""``DecodeBatch``: rows that join and leave between steps each decode as their prompt alone with ``generate``
(greedy, and sampled with a generator of their own), which itself equals a cache-free argmax loop."""

import dataclasses

import pytest
import torch

from tlm_model import ModelConfig, TransformerLM, generate, sample_next_token
from tlm_model.batching import DecodeBatch

CFG = ModelConfig(vocab_size=61, context_length=48, d_model=32, num_layers=2, num_heads=4, d_ff=64)


def _drive(model, requests, max_batch_size):
    """Schedule ``requests`` (arrival step, prompt, new tokens, temperature, seed) through one DecodeBatch:
    each step, waiting requests join while there is room, every row samples, finished rows leave, and the
    rest take one batched forward."""
    batch = DecodeBatch(model, max_batch_size)
    rows, logits, outputs = [], [], {i: [] for i in range(len(requests))}  # row r: request rows[r], logits[r]
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][0])
    step = 0
    while waiting or rows:
        while waiting and requests[waiting[0]][0] <= step and len(rows) < max_batch_size:
            i = waiting.pop(0)
            seed = requests[i][4]
            rows.append((i, None if seed is None else torch.Generator().manual_seed(seed)))
            logits.append(batch.add(requests[i][1]))
        step += 1
        tokens = []
        for r, (i, generator) in enumerate(rows):
            tokens.append(sample_next_token(logits[r], temperature=requests[i][3], generator=generator))
            outputs[i].append(int(tokens[-1]))
        for r in reversed(range(len(rows))):
            if len(outputs[rows[r][0]]) == requests[rows[r][0]][2]:
                moved = batch.remove(r)  # the last row takes its place
                assert moved == (None if r == len(rows) - 1 else len(rows) - 1)
                for items in (rows, tokens):
                    items[r] = items[-1]
                    items.pop()
        logits = list(batch.step(torch.stack(tokens)).unbind(0)) if rows else []
        assert batch.lengths == tuple(len(requests[i][1]) + len(outputs[i]) for i, _ in rows)
    return outputs


def test_rows_joining_and_leaving_decode_each_as_alone():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    gen = torch.Generator().manual_seed(1)
    requests = [(arrival, torch.randint(0, CFG.vocab_size, (n,), generator=gen), new, temperature, seed)
                for arrival, n, new, temperature, seed in [
                    (0, 5, 12, 0.0, None), (0, 17, 4, 1.0, 7), (2, 1, 20, 0.0, None), (3, 30, 9, 0.8, 11),
                    (3, 9, 15, 0.0, None), (9, 2, 6, 1.0, 7)]]  # fmt: skip
    outputs = _drive(model, requests, max_batch_size=3)  # more requests than rows: some wait for a free row
    for i, (_, prompt, new, temperature, seed) in enumerate(requests):
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        alone = generate(model, prompt, new, temperature=temperature, generator=generator)
        assert outputs[i] == alone[len(prompt) :].tolist(), i


def test_decode_steps_on_packed_weights_match_the_plain_ones():
    # pack_weights: the full bucket's steps run the Linear layers on MKL-packed copies (where torch has MKL);
    # every step's logits agree with an unpacked batch's to float32 rounding and the greedy tokens are the same.
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompts = [torch.randint(0, CFG.vocab_size, (n,)) for n in (3, 7, 1, 12, 5, 9, 2, 4)]
    batches = [DecodeBatch(model, 8, pack_weights=pack) for pack in (False, True)]
    logits = [b.add_many(prompts) for b in batches]
    for _ in range(6):
        # float32 sums over d_model or d_ff terms of O(1) products, in another order: a few ulps of O(1) logits.
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        tokens = logits[0].argmax(-1)
        assert torch.equal(logits[1].argmax(-1), tokens)
        logits = [b.step(tokens) for b in batches]


def test_a_full_batch_and_bad_prompts_are_refused():
    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 1)
    with pytest.raises(ValueError, match=r"prompt_ids must be a tensor of shape \(prompt,\) with 1 to 48 ids"):
        batch.add(torch.zeros(49, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prompt_ids must be a tensor of shape \(prompt,\)"):
        batch.add(torch.zeros(1, 3, dtype=torch.long))
    batch.add(torch.tensor([1, 2]))
    assert len(batch) == 1 and batch.lengths == (2,)
    with pytest.raises(ValueError, match="the batch has room for 1 rows, all in use"):
        batch.add(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"row must be in \[0, 0\], got 1"):
        batch.remove(1)
    assert batch.remove(0) is None and len(batch) == 0
    with pytest.raises(ValueError, match="min_slots must be >= 2, got 1"):  # a dynamic size of 1 is specialised
        DecodeBatch(model, 1, min_slots=1)


def _prompts(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("chunk", [4, 512])
def test_prompts_prefilled_together_equal_each_prefilled_alone(chunk):
    # Padded together and cut into chunks of `chunk` tokens (several prompts per forward, a long prompt over
    # several forwards): the logits are each prompt's full forward's, to float32 rounding; greedy tokens equal.
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompts = _prompts([5, 17, 1, 30, 9])
    batch = DecodeBatch(model, 6, prefill_chunk=chunk)
    batch.add(prompts[0])  # a row already decoding is left as it is
    logits = batch.add_many(prompts[1:])
    assert batch.lengths == tuple(len(p) for p in prompts)
    with torch.no_grad():
        for got, prompt in zip(logits, prompts[1:], strict=True):
            torch.testing.assert_close(got, model(prompt.unsqueeze(0))[0, -1], rtol=1e-5, atol=1e-5)
    out = [[] for _ in prompts]
    with torch.no_grad():
        first = torch.stack([model(prompts[0].unsqueeze(0))[0, -1], *logits])
    token = first.argmax(-1)
    for _ in range(8):
        for r, t in enumerate(token.tolist()):
            out[r].append(t)
        token = batch.step(token).argmax(-1)
    for r, prompt in enumerate(prompts):
        assert out[r] == generate(model, prompt, 8, temperature=0)[len(prompt) :].tolist(), r


def _drive_chunked(model, requests, max_batch_size, chunk, **batch_kwargs):
    """Greedy requests (arrival step, prompt, new tokens) through one DecodeBatch, one forward a step (``run``):
    each step joins the arrivals, then feeds every decoding row its token and up to ``chunk`` prompt tokens of
    each prefilling row in the same forward."""
    batch = DecodeBatch(model, max_batch_size, prefill_chunk=chunk, **batch_kwargs)
    owner, next_token, outputs = [], [], {i: [] for i in range(len(requests))}
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][0])
    step = 0
    while waiting or owner:
        while waiting and requests[waiting[0]][0] <= step and len(owner) < max_batch_size:
            i = waiting.pop(0)
            assert batch.join(requests[i][1]) == len(owner)
            owner.append(i)
            next_token.append(None)
        step += 1
        plan = {r: min(chunk, len(requests[owner[r]][1]) - batch.lengths[r]) for r in batch.prefilling}
        fed = torch.tensor([0 if t is None else t for t in next_token])
        decoding = any(t is not None for t in next_token)
        for row, logits in batch.run(fed if decoding else None, plan).items():
            if row not in batch.prefilling:
                next_token[row] = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        for r in reversed(range(len(owner))):
            if next_token[r] is None:
                continue
            outputs[owner[r]].append(next_token[r])
            if len(outputs[owner[r]]) == requests[owner[r]][2]:
                batch.remove(r)
                for items in (owner, next_token):
                    items[r] = items[-1]
                    items.pop()
    return outputs


def test_chunked_prefill_interleaved_with_decoding_rows_gives_each_its_tokens_alone():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    requests = [(arrival, prompt, new) for (arrival, new), prompt in zip(
        [(0, 10), (0, 6), (1, 12), (2, 4), (2, 9), (6, 5)], _prompts([3, 40, 7, 25, 2, 11]), strict=True)]  # fmt: skip
    outputs = _drive_chunked(model, requests, max_batch_size=4, chunk=8)
    for i, (_, prompt, new) in enumerate(requests):
        assert outputs[i] == generate(model, prompt, new, temperature=0)[len(prompt) :].tolist(), i


def test_a_full_row_is_refused_before_the_step_and_changes_nothing():
    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 2, capacity=4)
    batch.add(torch.tensor([1, 2, 3]))
    batch.add(torch.tensor([4]))
    batch.step(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match=r"rows \[0\] hold 4 tokens, the capacity"):
        batch.step(torch.tensor([7, 8]))
    assert batch.lengths == (4, 2)
    with pytest.raises(ValueError, match=r"tokens must have shape \(2,\), one per row, got \(3,\)"):
        batch.step(torch.tensor([7, 8, 9]))


@pytest.mark.slow
def test_the_decode_step_compiles_once_per_batch_bucket_and_never_again(monkeypatch):
    # Issue 34: one graph per (batch bucket, capacity), none across steps, rows joining and leaving, prompt
    # lengths, and rows growing across slot buckets (min_slots=8: the steps read 8, 16, 32 and all 48 slots;
    # the slot count is a dynamic size, so warm-up at 8 slots serves them all). A counting backend (dynamo's
    # graphs, no C++ build) and dynamo's own counters say how many; the slot counts the steps and prompt
    # chunks passed are recorded too. ~15 s: dynamo traces the model once per bucket and twice for prompt chunks.
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tlm_model import compile_for_inference, inference

    graphs = {"decode": [], "prefill": []}

    def counting(kind):
        def backend(graph_module, example_inputs):
            graphs[kind].append(graph_module)
            return graph_module.forward

        return backend

    monkeypatch.setitem(inference.DECODE_COMPILE_KWARGS, "cpu", {"backend": counting("decode"), "fullgraph": True,
                                                                  "dynamic": False})  # fmt: skip
    monkeypatch.setattr(inference, "PREFILL_COMPILE_KWARGS", {"backend": counting("prefill"), "fullgraph": True})
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TransformerLM(dataclasses.replace(CFG, num_layers=1)).eval()
    fast = compile_for_inference(model)
    read = {"decode": set(), "prefill": set()}
    shapes = {"decode": [], "prefill": []}  # the tokens' shape of each call, in order
    for kind in read:  # the slot counts each compiled call is given (its length is the graph's dynamic size)
        step = getattr(fast, f"{kind}_step")
        monkeypatch.setattr(
            fast, f"{kind}_step",
            lambda *a, step=step, kind=kind: read[kind].add(len(a[-1])) or shapes[kind].append(a[0].shape) or step(*a),
        )  # fmt: skip
    batch_kwargs = {"max_batch_size": 2, "chunk": 8, "min_slots": 8}
    DecodeBatch(fast, 2, prefill_chunk=8, min_slots=8).warm_up()  # buckets 1 and 2, prompt chunks of 1 and 2
    assert len(graphs["decode"]) == 2 and read["decode"] == {8}
    # Each graph first compiled at a size it serves (inductor's hints): a full chunk of one prompt (its two
    # halves in two grid rows, pack_chunks), then of two; the steps from the largest bucket down.
    assert shapes["prefill"][:2] == [(2, 4), (2, 4)] and [s[0] for s in shapes["decode"]] == [2, 1]
    warm_frames, warm_prefill = counters["stats"]["unique_graphs"], len(graphs["prefill"])
    requests = [(arrival, prompt, new) for (arrival, new), prompt in zip(
        [(0, 7), (0, 3), (1, 9), (2, 4), (5, 6), (6, 18)], _prompts([3, 20, 7, 13, 29, 28]), strict=True)]  # fmt: skip
    outputs = _drive_chunked(fast, requests, **batch_kwargs)
    assert read["decode"] == {8, 16, 32, CFG.context_length}  # every slot bucket, the whole capacity last
    assert read["prefill"] >= {8, 16, 32}
    assert len(graphs["decode"]) == 2  # no recompile of the step
    assert len(graphs["prefill"]) == warm_prefill  # prompt chunks: their sizes became dynamic in the warm-up
    assert counters["stats"]["unique_graphs"] == warm_frames
    for i, (_, prompt, new) in enumerate(requests):
        assert outputs[i] == generate(model, prompt, new, temperature=0)[len(prompt) :].tolist(), i
    torch._dynamo.reset()


def test_one_run_feeds_the_decoding_rows_and_the_prompt_chunks_in_one_forward_and_scores_on_request():
    # Issue 41 item 2: decoding rows' tokens and prompt chunks share one grid forward; every logit is the one the
    # model gives the sequence alone, and a row in `every` gets its chunk's logits after each token.
    torch.manual_seed(3)
    model = TransformerLM(CFG).eval()
    batch = DecodeBatch(model, 4)
    prompts = _prompts([5, 1, 9], seed=6)
    batch.add_many(prompts[:1])
    for prompt in prompts[1:]:
        batch.join(prompt)
    calls = []
    prefill = batch._prefill_fn
    batch._prefill_fn = lambda *args: calls.append(args[0].shape) or prefill(*args)
    out = batch.run(torch.tensor([7, 0, 0]), {1: 1, 2: 4}, every={2})
    assert len(calls) == 1 and batch.lengths == (6, 1, 4) and batch.prefilling == (2,)
    assert out[0].shape == (CFG.vocab_size,) and out[1].shape == (1, CFG.vocab_size) and out[2].shape[0] == 4
    with torch.no_grad():
        torch.testing.assert_close(out[0], model(torch.cat([prompts[0], torch.tensor([7])])[None])[0, -1],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(out[1][0], model(prompts[1][None])[0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[2], model(prompts[2][None, :4])[0], rtol=1e-5, atol=1e-5)
    for bad in ({0: 1}, {2: 6}, {2: 0}, {5: 1}):
        with pytest.raises(ValueError, match="chunks must name prefilling rows and 1 to their prompt tokens left"):
            batch.run(None, bad)
    assert batch.lengths == (6, 1, 4)


def test_every_position_gives_the_prompts_logits_from_the_same_prefill():
    torch.manual_seed(0)
    model = TransformerLM(CFG).eval()
    prompt = torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    scored, plain = DecodeBatch(model, 2), DecodeBatch(model, 2)
    every = scored.add(prompt, every_position=True)
    with torch.no_grad():
        torch.testing.assert_close(every, model(prompt.unsqueeze(0))[0], rtol=0, atol=1e-5)  # cache-free reference
    # The plain add's LM head runs on the last token alone (a (1, d_model) product, not (9, d_model)): the two
    # agree to float32 rounding of the head's GEMM; the keys and values cached are the same bits (the step below).
    torch.testing.assert_close(every[-1], plain.add(prompt), rtol=1e-6, atol=1e-6)
    token = torch.tensor([3])
    torch.testing.assert_close(scored.step(token), plain.step(token), rtol=0, atol=0)  # the same row was cached


@pytest.mark.parametrize("lengths", [[1], [2], [3], [8], [9], [1, 1, 1], [1, 5], [4, 4, 2], [16, 3], [32] + [1] * 16])
def test_prompt_chunks_are_packed_in_at_least_two_rows_and_columns_each_token_once(lengths):
    # Issue 41: dynamo specialises sizes of 1, so no chunk forward may have 1 row, 1 column or 1 picked logit.
    from tlm_model.batching import pack_chunks

    starts = [3 * c for c in range(len(lengths))]
    grid = pack_chunks(lengths, starts)
    assert grid.rows >= 2 and grid.width >= 2
    assert len(grid.positions) == grid.rows * grid.width == len(grid.owner) * grid.width
    flat = [cell for cells in grid.cells for cell in cells]
    assert sorted(flat) == flat and len(set(flat)) == sum(lengths)
    assert all(0 <= owner < len(lengths) for owner in grid.owner)  # a padding row too belongs to a chunk
    for c, (n, start, cells) in enumerate(zip(lengths, starts, grid.cells, strict=True)):
        assert len(cells) == n
        assert [grid.positions[i] for i in cells] == list(range(start, start + n))  # consecutive slots, in order
        assert {grid.owner[i // grid.width] for i in cells} == {c}
    padding = set(range(grid.rows * grid.width)) - set(flat)
    assert all(grid.positions[i] == -1 for i in padding)
    # Padding stays small: at most one cell per chunk (a decoding row's token costs 2 beside a prompt's chunk,
    # not the chunk's width), or the padding row of a grid of 2 cells.
    assert grid.rows * grid.width <= max(4, sum(lengths) + len(lengths))
    assert grid.width <= max(2, max(lengths))  # never wider than the longest chunk (or 2)


@pytest.mark.parametrize("max_batch", [1, 2, 3, 16, 17, 100, 256, 4096])
def test_batch_buckets_stay_within_dynamos_recompile_limit_and_hold_every_row_count(max_batch):
    # Issue 41: on CUDA every bucket is a graph of its own; past dynamo's recompile limit (8) the step would
    # silently run eager. --max-batch 256 made 9 powers of two.
    import torch._dynamo.config

    from tlm_model.batching import batch_bucket, batch_buckets

    buckets = batch_buckets(max_batch)
    assert len(buckets) <= torch._dynamo.config.recompile_limit
    assert buckets[0] == 1 and buckets[-1] == max_batch and list(buckets) == sorted(set(buckets))
    for rows in range(1, max_batch + 1):
        bucket = batch_bucket(rows, max_batch)
        assert bucket in buckets and bucket >= rows
        assert bucket <= max(2 * rows, buckets[1] if len(buckets) > 1 else 1)  # at most double, or the first >1

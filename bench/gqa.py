"""Decode with grouped-query attention: tlm against HF transformers' Llama at the Llama-3.2-1B shape, shrunk.

Usage: ``python bench/gqa.py [--repeats N] [--new-tokens N]`` from the repository root, in a venv with
torch and transformers (the workspace's ``packages/*/src`` are put on the path when tlm is not
installed). Writes docs/benchmarks-gqa.md.

Method. One random-weight ``LlamaForCausalLM`` with Llama-3.2-1B's GQA ratio (4 query heads per kv
head), head_dim 64, θ = 500 000, tied embeddings and llama3 RoPE scaling, shrunk in layers, width and
vocabulary; tlm's model is ``from_hf`` of it. Each row times greedy decoding of the same
prompt (tlm ``generate(temperature=0)`` against HF ``generate(do_sample=False)``), alternating
(ours, theirs, ours, ...) after a warm-up each, and reports medians and their ratio, so drift on a
shared machine hits both alike; the tokens are checked equal. Cache memory is counted from the
tensors each cache holds after the prompt and every new token: tlm's per-layer ``KVCache`` buffers
(allocated once for prompt + new tokens) and HF's ``DynamicCache`` layers, with the multi-head cache
the same model would need without GQA for comparison.
"""

import argparse
import datetime
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from _common import cpu_description, write_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import tlm_model  # noqa: F401
except ImportError:  # run from a checkout: use the workspace sources
    sys.path.extend(str(p) for p in sorted(ROOT.glob("packages/*/src")))

import transformers  # noqa: E402

from tlm_model import TransformerLM, from_hf, generate  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
LLAMA3 = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500_000.0,
}  # fmt: skip


def build(layers: int) -> tuple[transformers.LlamaForCausalLM, TransformerLM]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=131_072,
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=LLAMA3,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = from_hf(folder).eval()
    return hf, ours


def timed(fn) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf, ours = build(args.layers)
    prompt = torch.randint(0, 8192, (1, 32))
    mask = torch.ones_like(prompt)

    def run_ours() -> torch.Tensor:
        return generate(ours, prompt, args.new_tokens, temperature=0)

    def run_hf() -> torch.Tensor:
        return hf.generate(
            prompt, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip

    timed(run_ours), timed(run_hf)  # warm-up
    times: dict[str, list[float]] = {"tlm": [], "hf": []}
    for _ in range(args.repeats):
        t, a = timed(run_ours)
        times["tlm"].append(t)
        t, b = timed(run_hf)
        times["hf"].append(t)
        if not torch.equal(a, b):
            raise SystemExit("tlm and HF generated different tokens")
    tlm_s, hf_s = statistics.median(times["tlm"]), statistics.median(times["hf"])

    total = prompt.shape[1] + args.new_tokens
    cache = ours.new_kv_cache(1, capacity=total)
    tlm_bytes = sum(b.nbytes for b in (*cache.key_buffers, *cache.value_buffers))  # the allocation (+1 scratch slot)
    cfg = ours.config
    mha_bytes = tlm_bytes * cfg.num_heads // cfg.kv_heads
    with torch.no_grad():
        past = hf(torch.randint(0, 8192, (1, total)), use_cache=True).past_key_values
    hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in past.layers)

    rows = [
        "| measure | tlm | HF transformers | tlm / HF |",
        "|---|---|---|---|",
        f"| greedy decode, {args.new_tokens} new tokens after 32 (median of {args.repeats}) | {tlm_s * 1e3:.1f} ms "
        f"| {hf_s * 1e3:.1f} ms | {tlm_s / hf_s:.2f} |",
        f"| tokens/s | {args.new_tokens / tlm_s:.0f} | {args.new_tokens / hf_s:.0f} | {hf_s / tlm_s:.2f} |",
        f"| KV cache bytes at {total} tokens | {tlm_bytes:,} | {hf_bytes:,} | {tlm_bytes / hf_bytes:.2f} |",
        f"| the same cache without GQA (num_kv_heads = num_heads) | {mha_bytes:,} | | |",
    ]
    text = "\n".join(
        [
            "# Grouped-query decoding: tlm vs HF transformers",
            "",
            f"Written by `python bench/gqa.py` on {datetime.date.today()}, {cpu_description()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s).",
            f"Model: Llama-3.2-1B's attention shape shrunk to {args.layers} layers, d_model 512, 8 query heads over "
            "2 kv heads, head_dim 64, vocab 8192, tied embeddings, llama3 RoPE scaling; random weights, "
            "tlm's model loaded with `from_hf`. Tokens checked equal on every run.",
            "Timings alternate tlm and HF in one process; read the ratio, not the absolute times (a shared "
            "machine). tlm runs eager here; `compile_for_inference` is its fast decoding path (docs/benchmarks.md).",
            "",
            *rows,
            "",
        ]
    )
    write_section("gqa", text, DOC)
    print(text)


if __name__ == "__main__":
    main()

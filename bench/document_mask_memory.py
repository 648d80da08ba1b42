"""Memory of one attention layer over a T=4096 packed window under a document mask, on this CPU (issue 42).

    python bench/document_mask_memory.py [--seq 4096] [--heads 16] [--d-head 32]

Each variant runs in a fresh process: one warm-up call (FlexAttention compiles there), then the peak resident
memory is reset (``/proc/self/clear_refs``) and one measured call runs; its figure is the peak above the
resident memory before it (inputs included in neither). Variants:

- ``mask``: the bytes of the mask itself: the dense (batch, 1, T, T) boolean mask against the ``BlockMask``
  that ``tlm_attention.documents.document_block_mask`` builds block by block.
- ``math``: torch's SDPA on its math kernel under the dense mask, forward and backward: what a deterministic
  CUDA run used before this change (flash takes no mask; memory-efficient and cuDNN are off there).
- ``cpu``: torch's SDPA as a CPU picks it under the dense mask (its fused CPU kernel), forward and backward: the
  CPU's path, before and after (FlexAttention has no CPU backward).
- ``math-forward`` / ``flex-forward``: the forward alone (scoring), math kernel vs compiled FlexAttention.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tlm_attention import document_ids, document_mask
from tlm_attention.documents import document_block_mask
variant, seq, heads, d_head = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
tokens = torch.randint(1, 100, (1, seq))
tokens[0, torch.randint(0, seq, (6,))] = 0  # seven documents
ids = document_ids(tokens, 0)

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def run(grad):
    q, k, v = (torch.randn(1, heads, seq, d_head, requires_grad=grad) for _ in range(3))
    def call():
        if variant.startswith("flex"):
            from torch.nn.attention.flex_attention import flex_attention
            global compiled
            compiled = globals().get("compiled") or torch.compile(flex_attention, dynamic=False)
            with torch.no_grad():
                return compiled(q, k, v, block_mask=document_block_mask(ids))
        if variant.startswith("math"):
            with sdpa_kernel(SDPBackend.MATH), torch.set_grad_enabled(grad):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids))
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids))
        if grad:
            out.square().sum().backward()
        return out
    call()  # warm-up (compiles FlexAttention)
    q.grad = k.grad = v.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size (VmHWM)
    before = status("VmRSS")
    out = call()
    return status("VmHWM") - before

if variant == "mask":
    dense = document_mask(ids)
    block = document_block_mask(ids)
    nbytes = sum(t.numel() * t.element_size() for t in block.as_tuple() if isinstance(t, torch.Tensor))
    print(json.dumps({"dense_bytes": dense.numel() * dense.element_size(), "block_mask_bytes": nbytes}))
else:
    print(json.dumps({"peak_bytes": run(grad=not variant.endswith("forward"))}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-head", type=int, default=32)
    parser.add_argument("--print-only", action="store_true", help="print the figures; leave docs/benchmarks.md")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [os.path.join(root, "packages", p, "src") for p in sorted(os.listdir(os.path.join(root, "packages")))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    results = {}
    for variant in ("mask", "math", "cpu", "math-forward", "flex-forward"):
        done = subprocess.run([sys.executable, "-c", CHILD, variant, str(args.seq), str(args.heads), str(args.d_head)],
                              env=env, capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode:
            results[variant] = {"error": done.stderr.strip().splitlines()[-1]}
        else:
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        print(variant, results[variant], flush=True)
    print(json.dumps({"seq": args.seq, "heads": args.heads, "d_head": args.d_head, **results}))
    if not args.print_only:
        write(args, results)


def write(args: argparse.Namespace, results: dict) -> None:
    import datetime

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import cpu_description, write_section

    def mib(variant: str) -> str:
        r = results[variant]
        return f"{r['peak_bytes'] / 2**20:,.1f}" if "peak_bytes" in r else f"failed: {r['error'][:80]}"

    mask = results["mask"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Document masks: a T=4096 packed window's attention memory, dense mask vs FlexAttention's block mask",
        "",
        f"Measured {date} on {cpu_description()}, torch {torch.__version__}, one thread: one attention layer, batch 1, "
        f"{args.heads} heads of {args.d_head}, {args.seq} tokens holding seven documents. Each variant runs in a "
        "fresh process after one warm-up call; its figure is the peak resident memory of one call above the "
        "resident memory before it (`VmHWM` reset through `/proc/self/clear_refs`). Method: the script's docstring.",
        "",
        "| what | MiB |",
        "| --- | ---: |",
        *(f"| {what} | {value} |" for what, value in (
            ("the dense (1, 1, T, T) boolean mask", f"{mask['dense_bytes'] / 2**20:,.2f}"),
            ("the `BlockMask` built from the document ids (`document_block_mask`)",
             f"{mask['block_mask_bytes'] / 2**20:,.3f}"),
            ("SDPA's math kernel under the dense mask, forward + backward (a deterministic CUDA run before)",
             mib("math")),
            ("SDPA as the CPU picks it under the dense mask, forward + backward (the CPU's path, before and after)",
             mib("cpu")),
            ("SDPA's math kernel under the dense mask, forward only", mib("math-forward")),
            ("compiled FlexAttention under the block mask, forward only (the block mask built in the call)",
             mib("flex-forward")),
        )),
        "",
        "On CUDA a document-masked training step now runs FlexAttention (flash takes no mask, and a deterministic run "
        "has only the math kernel besides); FlexAttention has no CPU backward, so a CPU keeps the dense mask and its "
        "fused CPU kernel. The CUDA figures are the GPU check's to take.",
    ]  # fmt: skip
    write_section("document_mask_memory", "\n".join(lines))


if __name__ == "__main__":
    main()

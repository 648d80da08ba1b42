"""Which inductor settings make compile_for_inference decode fastest on this CPU.

Greedy decoding of the course-tinystories model (batch 1, 16 + 240 tokens, 2 threads), compiled three
ways against eager in the same process; each variant runs in a fresh process, since dynamo's cache is
keyed by guards that do not include inductor's config (in one process a later variant can run an
earlier one's compiled code):

- ``prepacked``: what compile_for_inference does: frozen weights, pre-packed for oneDNN (the default of
  ``cpp.weight_prepack``);
- ``frozen``: frozen weights, not pre-packed: the linears stay MKL matmuls;
- ``unfrozen``: no freezing.

    python bench/compile_variants.py        # prints one line per variant; compare the "x eager" column
"""

import statistics
import subprocess
import sys
import time

VARIANTS = {
    "prepacked": {"freezing": True},
    "frozen": {"freezing": True, "cpp.weight_prepack": False},
    "unfrozen": {"freezing": False},
}


def run(variant: str) -> None:
    import torch
    import torch._inductor.config as inductor_config

    from tlm_model import TransformerLM, generate
    from tlm_model.inference import COMPILE_KWARGS

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = TransformerLM.from_preset("course-tinystories").eval()
    compiled = torch.compile(model, **COMPILE_KWARGS)
    patch = VARIANTS[variant]

    class Compiled(torch.nn.Module):  # what generate needs: config, new_kv_cache and a forward
        config = model.config
        new_kv_cache = staticmethod(model.new_kv_cache)

        def forward(self, *args, **kwargs):
            with torch.no_grad(), inductor_config.patch(patch):
                return compiled(*args, **kwargs)

    prompt = torch.randint(0, model.config.vocab_size, (1, 16))
    runs = {"eager": model, variant: Compiled()}
    expected = generate(model, prompt, 240, temperature=0)
    start = time.perf_counter()
    same = torch.equal(generate(runs[variant], prompt, 240, temperature=0), expected)  # compiles
    compile_s = time.perf_counter() - start
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(5):  # alternating, so drift on a shared machine hits both alike
        for name, fn in runs.items():
            start = time.perf_counter()
            generate(fn, prompt, 240, temperature=0)
            seconds[name].append(time.perf_counter() - start)
    eager, ours = (240 / statistics.median(seconds[n]) for n in ("eager", variant))
    print(
        f"{variant:<10} {ours:6.1f} tok/s  eager {eager:6.1f} tok/s  {ours / eager:4.2f}x eager  "
        f"compile+first {compile_s:5.1f} s  same tokens as eager: {same}",
        flush=True,
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        run(sys.argv[2])
        return
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(variant)]
        print(lines[-1] if done.returncode == 0 and lines else f"{variant}: failed\n{done.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()

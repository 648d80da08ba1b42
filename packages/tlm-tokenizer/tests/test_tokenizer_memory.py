"""Tokenizer.encode_iterable streams in bounded memory: checked in a subprocess under an address-space limit."""

import subprocess
import sys
import textwrap

import pytest
from processes import same_code_env

SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import tlm_tokenizer.tokenizer as module
    from tlm_tokenizer import Tokenizer

    # The cache's capacity scaled down with the file (2**18 entries hold up to about 100 MB): what is
    # checked is that nothing else grows with the text.
    module.CACHE_ENTRIES = 1 << 14
    # Bytes only: what is measured is memory, which merges do not change (and GPT-2 takes a second to load).
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    path, mode = sys.argv[1], sys.argv[2]
    tokenizer.encode("warm up the caches' code paths <|endoftext|> once")
    # Allow 30 MB more address space than is mapped now; the file is 4 MB of text, whose list of
    # pieces alone would need more.
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 30_000_000, resource.RLIM_INFINITY))
    count = 0
    with open(path, encoding="utf-8", newline="") as handle:
        if mode == "iterable":
            for _ in tokenizer.encode_iterable(handle):
                count += 1
        else:
            count = len(tokenizer.encode(handle.read()))
    print(count)
    """
)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    # 4 MB of lines with ever-new words, so an unbounded cache would also blow the limit.
    path = tmp_path_factory.mktemp("big") / "big.txt"
    with open(path, "w", encoding="utf-8", newline="") as handle:
        for line in range(40_000):
            words = " ".join(f"w{line * 7 + k:x}" for k in range(9))
            handle.write(f"Line {line}: {words}, and more.\n" + ("<|endoftext|>" if line % 20_000 == 0 else ""))
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux-specific")
@pytest.mark.slow
def test_encode_iterable_fits_where_encode_does_not(big_file):
    args = [sys.executable, "-c", SCRIPT, str(big_file)]
    streamed = subprocess.run([*args, "iterable"], capture_output=True, text=True, timeout=600, env=same_code_env())
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert int(streamed.stdout) == big_file.stat().st_size - 2 * 12  # one id per byte, one per special token
    # The control: the same limit is too small for encode() of the whole text, so the limit bites.
    whole = subprocess.run([*args, "whole"], capture_output=True, text=True, timeout=600, env=same_code_env())
    assert whole.returncode != 0 and "MemoryError" in whole.stderr

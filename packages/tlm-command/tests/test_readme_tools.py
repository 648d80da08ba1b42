"""The root README's commands that call another tool run as written, offline, with the versions the set-up
installs: lm-evaluation-harness's three commands on local JSON Lines tasks, the server's ``curl`` and ``openai``
examples, and the journey's ``transformers`` pipeline line. Each is read from the README's own text and run by bash
in a folder laid out as the README's (``runs/plays``: a tiny run trained here; ``held_out.txt``); only the port (the
server's is chosen free) and ``max_length`` (the tiny run's context is 128, the README's 256) are replaced."""

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "README.md"
pytestmark = [
    pytest.mark.skipif(not README.is_file(), reason="the tlm monorepo's README.md is not beside this installed copy"),
    pytest.mark.slow,  # a server process, lm-eval and transformers processes
]


def _bash_block(after: str) -> str:
    """The first ```bash block after the heading or text ``after``."""
    text = README.read_text(encoding="utf-8").split(after, 1)[1]
    return re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL).group(1)


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # this venv's python, tlm and lm_eval first
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


@pytest.fixture(scope="module")
def folder(corpus, tmp_path_factory):
    """The README's layout: runs/plays (a tiny run, context 128: the README's requests fit), hf/plays (its HF
    export), held_out.txt."""
    from tlm_command.main import main
    from tlm_train import TrainConfig, default_corpus, train

    here = tmp_path_factory.mktemp("readme")
    model = {"context_length": 128, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64}
    train(TrainConfig(out_dir=str(here / "runs" / "plays"), data=[str(corpus)], vocab_size=320, steps=2, batch_size=2,
                      eval_batches=1, warmup_steps=1, peak_flops=1e9, sample_tokens=0, model=model))  # fmt: skip
    assert main(["convert", "--to-hf", str(here / "runs" / "plays"), "--out", str(here / "hf" / "plays")]) == 0
    speeches = [p.strip() for p in default_corpus().split("\n\n") if len(p.strip()) > 80][:260]
    (here / "held_out.txt").write_text("\n\n".join(speeches), encoding="utf-8")
    return here


@pytest.fixture(scope="module")
def port(folder):
    """``tlm serve`` as the README starts it (its own line, on a free port, not compiled); its port."""
    block = _bash_block("**Evaluating with lm-evaluation-harness**")
    line = next(x for x in block.splitlines() if x.startswith("tlm serve"))
    argv = [*line.rstrip(" &").split()[1:], "--port", "0", "--quiet", "--no-compile"]
    process = subprocess.Popen([sys.executable, "-m", "tlm", *argv], cwd=folder, env=_env(), stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    first = process.stderr.readline()
    assert " on http://127.0.0.1:" in first, first + process.stderr.read()
    threading.Thread(target=process.stderr.read, daemon=True).start()
    number = first.split("127.0.0.1:")[1].split("/")[0]
    deadline = time.monotonic() + 120  # uvicorn listens once started: seconds on a busy machine
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{number}/health", timeout=5)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.05)
    yield number
    process.terminate()
    process.wait(timeout=30)


def _run(block: str, folder: Path, port: str) -> str:
    kept = [line for line in block.splitlines() if not line.startswith(("tlm serve", "kill %1"))]
    script = "\n".join(kept).replace("8000", port).replace("max_length=256", "max_length=128")
    script = script.replace("max_length=254", "max_length=126")
    done = subprocess.run(["bash", "-e", "-c", script], cwd=folder, env=_env(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_the_lm_eval_commands_score_the_local_json_lines_tasks(folder, port):
    out = _run(_bash_block("**Evaluating with lm-evaluation-harness**"), folder, port)
    assert len((folder / "tasks" / "held_out.jsonl").read_text().splitlines()) == 40
    # Three result tables: local-completions (both tasks), local-chat-completions (generation), hf (both).
    assert out.count("|held_out_gen|") == 3 and out.count("|held_out    |") + out.count("|held_out|") >= 2, out
    assert out.count("bits_per_byte") == 2, out


def test_the_servers_curl_and_openai_examples(folder, port):
    out = _run(_bash_block("## Serving with OpenAI's API"), folder, port)
    assert out.count('"object":"text_completion"') == 1 and "data: [DONE]" in out, out


def test_the_journeys_transformers_line(folder):
    line = next(x for x in _bash_block("## From text to Hugging Face").splitlines() if "from transformers" in x)
    out = _run(line, folder, "")
    assert out.startswith("HAMLET."), out

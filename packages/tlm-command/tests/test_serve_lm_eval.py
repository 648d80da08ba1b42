"""lm-evaluation-harness end to end: the same tiny trained run scored by lm-eval's ``hf`` model on its
``tlm convert --to-hf`` export and by lm-eval's ``local-completions`` / ``local-chat-completions`` against
``tlm serve`` (a process) serving that export.

The reference is HF transformers running the export inside lm-eval: per-item log-likelihoods agree to 1e-4, greedy
generations are identical, and the aggregate metrics are equal. The tasks are local JSON Lines written here: a
multiple-choice log-likelihood task, a ``loglikelihood_rolling`` perplexity task and a ``generate_until`` task.
The run's context is 32 tokens, the API models' ``max_length``: they keep one token for the ``max_tokens: 1`` they
send with each scored prompt and cut rolling windows one token shorter again, so lm-eval's ``hf`` model gets
``max_length=30``, which makes every window and every scored token the same for both.
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval[api] is in tlm-command's test extra")
pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")

pytestmark = pytest.mark.slow  # a server process and three lm-eval runs

MC = [
    {"question": "import", "choices": [" os", " the", " 12"], "answer": 0},
    {"question": "The", "choices": [" module", " def", " ("], "answer": 0},
    {"question": "def main(", "choices": ["):", " x", "self"], "answer": 2},
    {"question": "Python is a", "choices": [" language", " snake", " file object"], "answer": 0},
]
ROLLING = [
    {"text": "The os module provides a portable way of using operating system dependent functionality."},
    {"text": "Return the value of the named attribute of object."},
]
GENERATE = [
    {"question": "import", "answer": " os"},
    {"question": "The", "answer": " file"},
    {"question": "def", "answer": " main"},
]
#: The export's chat template: the server's plain one (one "Role: content" line per message, then "Assistant:"),
#: so that lm-eval's ``hf`` model renders what ``tlm serve`` renders.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}Assistant:"


def _tasks(folder):
    """Three task YAMLs over JSON Lines files in ``folder``; returns their names."""
    data = {"mc": MC, "rolling": ROLLING, "generate": GENERATE}
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
    (folder / "tlm_mc.yaml").write_text(
        "task: tlm_mc\n" + common.format(path=folder / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )  # fmt: skip
    (folder / "tlm_rolling.yaml").write_text(
        "task: tlm_rolling\n" + common.format(path=folder / "rolling.jsonl")
        + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )  # fmt: skip
    (folder / "tlm_generate.yaml").write_text(
        "task: tlm_generate\n" + common.format(path=folder / "generate.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )  # fmt: skip
    return ["tlm_mc", "tlm_rolling"], ["tlm_generate"]


@pytest.fixture(scope="module")
def export(run, tmp_path_factory):
    """The run's HF export, with the plain chat template written into it."""
    from tlm_command.main import main

    out = tmp_path_factory.mktemp("lm_eval") / "hf"
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(export):
    process = subprocess.Popen(
        [sys.executable, "-m", "tlm", "serve", "--checkpoint", str(export), "--port", "0", "--model-name", "tiny",
         "--dtype", "float32", "--quiet", "--no-compile"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    line = process.stderr.readline()
    assert " on http://127.0.0.1:" in line, line + process.stderr.read()
    threading.Thread(target=process.stderr.read, daemon=True).start()
    url = "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split("/")[0]
    deadline = time.monotonic() + 120  # uvicorn listens once started: seconds on a busy machine
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=30)


def _evaluate(model, model_args, tasks, folder, **kwargs):
    from lm_eval.tasks import TaskManager

    # Only the tasks written here: indexing lm-eval's own thousands of task files would take seconds a run.
    tasks_here = TaskManager(include_path=str(folder), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                      task_manager=tasks_here, bootstrap_iters=0, **kwargs)  # fmt: skip
    return results


def _per_item(results, task):
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in sample["resps"]] for sample in samples]


def _metrics(results, task):
    return {k: v for k, v in results["results"][task].items() if "_stderr" not in k and isinstance(v, (int, float))}


def test_lm_eval_scores_the_same_through_tlm_serve_as_on_the_hf_export(export, server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    scoring, generating = _tasks(tmp_path)
    hf = _evaluate("hf", f"pretrained={export},max_length=30,dtype=float32", scoring, tmp_path,
                   device="cpu", batch_size=4, apply_chat_template=False)  # fmt: skip
    hf_chat = _evaluate("hf", f"pretrained={export},max_length=30,dtype=float32", generating, tmp_path, device="cpu",
                        batch_size=1, apply_chat_template=True)  # fmt: skip
    served = _evaluate(
        "local-completions",
        f"model=tiny,base_url={server}/v1/completions,tokenizer={export},tokenizer_backend=huggingface,"
        "max_length=32,batch_size=4",
        scoring,
        tmp_path,
    )
    chat = _evaluate("local-chat-completions", f"model=tiny,base_url={server}/v1/chat/completions,max_length=32",
                     generating, tmp_path, apply_chat_template=True)  # fmt: skip

    table = {"hf": {}, "local-completions": {}, "hf (chat template)": {}, "local-chat-completions": {}}
    worst = 0.0
    for task in scoring:
        ours, reference = _per_item(served, task), _per_item(hf, task)
        assert len(ours) == len(reference) > 0
        for mine, theirs in zip(ours, reference, strict=True):
            lls = [r[0] if isinstance(r, (list, tuple)) else r for r in mine]
            ref = [r[0] if isinstance(r, (list, tuple)) else r for r in theirs]
            worst = max(worst, *(abs(a - b) for a, b in zip(lls, ref, strict=True)))
            assert worst < 1e-4, (task, lls, ref)
        assert _metrics(served, task).keys() == _metrics(hf, task).keys()
        for key, value in _metrics(hf, task).items():
            assert _metrics(served, task)[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, key)
        table["hf"][task], table["local-completions"][task] = _metrics(hf, task), _metrics(served, task)
    for task in generating:
        assert _per_item(chat, task) == _per_item(hf_chat, task)
        assert any(text for item in _per_item(chat, task) for text in item)  # something was generated
        assert _metrics(chat, task) == _metrics(hf_chat, task)
        table["hf (chat template)"][task], table["local-chat-completions"][task] = (
            _metrics(hf_chat, task), _metrics(chat, task),
        )  # fmt: skip
    print(json.dumps(table, indent=1), f"\nlargest per-item log-likelihood difference: {worst:.3g}")

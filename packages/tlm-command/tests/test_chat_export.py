"""A chat fine-tune through the command: ``tlm train --data chat.jsonl`` -> ``tlm convert --to-hf`` ->
transformers' ``apply_chat_template`` on the exported folder gives the ids tlm trained on; ``tlm serve`` renders
the run's template and stops at its end marker."""

import json

import pytest

import tlm_artifacts as artifacts
from tlm_command.main import main
from tlm_tokenizer import Tokenizer
from tlm_tokenizer.chat import CHATML_TEMPLATE, IM_END, ChatTemplate

transformers = pytest.importorskip("transformers")

SMALL = ["--context-length", "64", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--d-ff", "64",
         "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e9", "--warmup-steps", "1",
         "--sample-tokens", "0", "--quiet"]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is  2+2 ?\nSay it."},
    {"role": "assistant", "content": " four, of course"},
]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    records = [{"prompt": f"question {i} about cats", "completion": f"answer {i}: dogs"} for i in range(30)]
    records += [{"messages": CONVERSATION}] * 4
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    run = folder / "run"
    argv = ["train", "--data", str(data), "--vocab-size", "300", "--steps", "2", "--out-dir", str(run), *SMALL]
    assert main(argv) == 0
    return run


def test_transformers_apply_chat_template_on_the_export_gives_tlms_ids(chat_run, tmp_path):
    assert main(["convert", "--to-hf", str(chat_run), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = Tokenizer.load(chat_run / "tokenizer")
    assert ours.chat_template == CHATML_TEMPLATE
    for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[:2]):
        expected = list(hf.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert ChatTemplate(ours, ours.chat_template).encode(messages).ids == expected
    # The generation config ends a chat turn at <|im_end|> as well as at <|endoftext|>.
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ours.encode("<|endoftext|>")[0], ours.encode(IM_END)[0]]
    # Read back into tlm, the folder keeps its template.
    assert Tokenizer.from_hf(tmp_path / "hf").chat_template == CHATML_TEMPLATE


def test_serve_renders_the_runs_template_with_the_generation_prompt(chat_run):
    from tlm_command.serve import _chat_template

    artifact = artifacts.resolve(str(chat_run))
    render = _chat_template(artifact, artifacts.load_tokenizer(artifact))
    assert render(CONVERSATION[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is  2+2 ?\nSay it.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

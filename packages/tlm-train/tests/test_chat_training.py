"""Chat SFT: a chat file trains with the default ChatML template stored with the run's tokenizer, the loss
counts only the assistant's tokens (equal to a hand-computed masked loss), packed or padded, and a fine-tune
from a run whose tokenizer lacks the markers grows the vocabulary."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tlm_model import load_model_file
from tlm_tokenizer.chat import CHAT_MARKERS, CHATML_TEMPLATE, compile_template
from tlm_train import EvalBatches, RunDir, TrainConfig, train

WORDS = "the cat sat on a mat and then ran far away from every dog it saw".split()


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    lines = []
    for i in range(40):
        ask = " ".join(rng.choice(WORDS, size=rng.integers(2, 6)))
        answer = " ".join(rng.choice(WORDS, size=rng.integers(2, 6)))
        if i % 2:
            lines.append({"prompt": ask, "completion": answer})
        else:
            lines.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return path, lines


def _messages(record):
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def test_the_masked_loss_equals_a_hand_computed_one(tmp_path, make_config, chat_file):
    path, lines = chat_file
    config = make_config(data=[str(path)], vocab_size=300, steps=2, chat_layout="padded", model={
        "context_length": 32, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64})  # fmt: skip
    result = train(config)
    run = RunDir(tmp_path / "run")
    tokenizer = run.tokenizer()
    assert tokenizer.chat_template == CHATML_TEMPLATE and set(CHAT_MARKERS) <= set(tokenizer.special_tokens)
    saved = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHATML_TEMPLATE
    info = json.loads((tmp_path / "run" / "data" / "info.json").read_text())
    assert info["chat"] == {"examples": 40, "train_on": "completion", "layout": "padded", "cut_to_context": 0}
    # The first validation row is the first validation example (36 train, 4 validation), padded to 33 tokens.
    model = load_model_file(result.checkpoint / "model.safetensors").eval()
    val = np.load(tmp_path / "run" / "data" / "val.npy")
    inputs, targets = next(iter(EvalBatches(val, 1, 32, stride=33)))
    with torch.no_grad():
        got = model.loss(inputs, targets)
        # By hand: the ids of the rendered text, and the assistant's tokens counted from the rendered prompt.
        render = compile_template(CHATML_TEMPLATE)
        messages = _messages(lines[36])
        full = tokenizer.encode(render(messages=messages, add_generation_prompt=False))
        prompt = tokenizer.encode(render(messages=messages[:1], add_generation_prompt=True))
        assert inputs[0, : len(full)].tolist() == full and full[: len(prompt)] == prompt
        logits = model(torch.tensor([full]))[0].double()
        picked = -F.log_softmax(logits, -1)[torch.arange(len(full) - 1), torch.tensor(full[1:])]
        expected = picked[len(prompt) - 1 :].mean()  # targets from the first assistant token to the end
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert (targets[0] != -100).sum() == len(full) - len(prompt)


@pytest.mark.parametrize("train_on", ["prompt", "all"])
def test_train_on_picks_the_other_tokens_or_all(tmp_path, make_config, chat_file, train_on):
    path, _ = chat_file
    train(make_config(data=[str(path)], vocab_size=300, steps=1, train_on=train_on))
    stored = np.load(tmp_path / "run" / "data" / "train.npy")
    separators = int((stored == -1 - RunDir(tmp_path / "run").tokenizer().encode("<|endoftext|>")[0]).sum())
    skipped = int((stored < 0).sum()) - separators
    assert stored.dtype == np.int32
    assert (skipped == 0) if train_on == "all" else (0 < skipped < len(stored) / 2)  # prompt: the answers skipped


def test_a_fine_tune_from_a_run_without_the_markers_grows_the_vocabulary(tmp_path, make_config, chat_file):
    path, _ = chat_file
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 200), encoding="utf-8")
    base = train(make_config(data=[str(text)], vocab_size=290, steps=1, out_dir=str(tmp_path / "base")))
    base_model = load_model_file(base.checkpoint / "model.safetensors")
    result = train(make_config(data=[str(path)], init_from=str(tmp_path / "base"), steps=1, lr=1e-9, warmup_steps=0,
                               weight_decay=0.0))  # fmt: skip
    grown = load_model_file(result.checkpoint / "model.safetensors")
    assert grown.config.vocab_size == base_model.config.vocab_size + 2
    assert TrainConfig.from_toml(tmp_path / "run" / "train.toml").model["vocab_size"] == grown.config.vocab_size
    # The new rows started as the mean of the old ones (one step at lr 1e-9 moves them by ~1e-9).
    old = base_model.token_embeddings.weight
    torch.testing.assert_close(grown.token_embeddings.weight[-2:], old.mean(0).expand(2, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(grown.token_embeddings.weight[: old.shape[0]], old, rtol=0, atol=1e-6)


def test_chat_and_text_files_together_are_refused(tmp_path, make_config, chat_file):
    text = tmp_path / "t.txt"
    text.write_text("some text", encoding="utf-8")
    with pytest.raises(ValueError, match="mixes chat files"):
        train(make_config(data=[str(chat_file[0]), str(text)], vocab_size=300))


def test_a_malformed_record_is_named_by_file_and_line(tmp_path, make_config):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2.*content"):
        train(make_config(data=[str(path)], vocab_size=300))


def test_a_users_template_file_is_used_and_stored(tmp_path, make_config, chat_file):
    template = tmp_path / "zephyr.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
        encoding="utf-8",
    )
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
    train(make_config(data=[str(chat_file[0])], vocab_size=300, steps=1, chat_template=str(template),
                      special_tokens=specials))  # fmt: skip
    tokenizer = RunDir(tmp_path / "run").tokenizer()
    assert tokenizer.chat_template == template.read_text() and tokenizer.special_tokens == specials
    stored = np.load(tmp_path / "run" / "data" / "train.npy")
    ids = np.where(stored < 0, -1 - stored, stored)
    first = tokenizer.decode(ids[: int(np.argmax(ids == tokenizer.encode("<|endoftext|>")[0]))].tolist())
    messages = _messages(chat_file[1][0])
    assert first == f"<|user|>\n{messages[0]['content']}<|end|>\n<|assistant|>\n{messages[1]['content']}<|end|>\n"


def test_a_resumed_chat_run_is_bit_identical_and_keeps_its_chat_settings(tmp_path, make_config, chat_file):
    from safetensors.torch import load_file

    def config(out, steps, **more):
        return make_config(data=[str(chat_file[0])], vocab_size=300, steps=steps, checkpoint_interval=2,
                           out_dir=str(tmp_path / out), document_mask=True, **more)  # fmt: skip

    straight = train(config("straight", 4))
    train(config("resumed", 2))
    resumed = train(config("resumed", 4), resume=True)
    a = load_file(straight.checkpoint / "model.safetensors")
    b = load_file(resumed.checkpoint / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--train-on 'all' differs from the run's 'completion'"):
        train(config("resumed", 6, train_on="all"), resume=True)


@pytest.mark.parametrize(
    ("template", "message"),
    [(None, "no such file"), ("{% for m in messages %", "not valid Jinja")],
    ids=["missing", "bad"],
)
def test_a_chat_template_that_cannot_be_used_is_refused_before_anything_is_written(
    tmp_path, make_config, chat_file, template, message
):
    path = tmp_path / "t.jinja"
    if template is not None:
        path.write_text(template, encoding="utf-8")
    with pytest.raises((FileNotFoundError, ValueError), match=f"--chat-template {path}: .*{message}"):
        train(make_config(data=[str(chat_file[0])], vocab_size=300, chat_template=str(path)))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("role", ["user<|im_end|>", "narrator"])
def test_a_role_outside_the_declared_set_is_named_by_file_and_line(tmp_path, make_config, role):
    path = tmp_path / "roles.jsonl"
    path.write_text('{"prompt": "hi", "completion": "yo"}\n' + json.dumps({"messages": [{"role": role,
                    "content": "hi"}]}) + "\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"^--data .*roles.jsonl line 2\[0\]: role must be one of system, "):
        train(make_config(data=[str(path)], vocab_size=300))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("case", ["no assistant", "no assistant in the validation split", "cut by the context"])
def test_chat_data_that_leaves_no_target_is_refused_before_training(tmp_path, make_config, case):
    # 20 conversations; 2 (the last 10%) are the validation split. A user turn alone leaves no assistant token to
    # train on; padded rows of the context (16 tokens) cut an answer that comes after a long question.
    asked = {"messages": [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on a mat"}]}
    alone = {"messages": [{"role": "user", "content": "the cat sat on a mat"}]}
    long = {"prompt": " ".join(WORDS * 4), "completion": "the end"}
    records = {"no assistant": [alone] * 20, "no assistant in the validation split": [asked] * 18 + [alone] * 2,
               "cut by the context": [long] * 20}[case]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    expected = ("^the validation split of --data: no token of its conversations is a target .*would measure nothing$"
                if case == "no assistant in the validation split" else
                "^--data .*: no token of its conversations is a target .*: nothing would train$")  # fmt: skip
    with pytest.raises(ValueError, match=expected):
        train(make_config(data=[str(path)], vocab_size=300, steps=1, val_fraction=0.1, chat_layout="padded"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_chat_template_that_loops_is_stopped_naming_the_line(tmp_path, make_config, chat_file, monkeypatch):
    import tlm_tokenizer.chat

    monkeypatch.setattr(tlm_tokenizer.chat, "RENDER_SECONDS", 0.2)
    template = tmp_path / "loops.jinja"
    loop = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    template.write_text(loop + CHATML_TEMPLATE)
    with pytest.raises(ValueError, match=r"^--data .*chat.jsonl line 1: the chat template took more than 0.2 s"):
        train(make_config(data=[str(chat_file[0])], vocab_size=300, chat_template=str(template)))
    assert not (tmp_path / "run" / "checkpoints").exists()

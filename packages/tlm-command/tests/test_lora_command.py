"""LoRA through the command: ``tlm train --lora-rank``, ``tlm convert --to-peft`` read by HF peft itself,
``--to-hf --merge`` read by transformers, and a LoRA run or a PEFT adapter folder as any command's model."""

import json
from pathlib import Path

import pytest
import torch

import tlm_artifacts as artifacts
from tlm_command.main import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ALL = "q,k,v,o,w1,w2,w3,lm_head"


@pytest.fixture(scope="module")
def lora_run(run: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    argv = ["train", "--init-from", str(run), "--data", str(corpus), "--out-dir", str(out), "--steps", "3",
            "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e9", "--sample-tokens", "0",
            "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ALL, "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def exported(run: Path, lora_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base's HF export, the LoRA run's PEFT adapter for it, and the merged HF export."""
    root = tmp_path_factory.mktemp("exports")
    paths = {"hf": root / "hf", "peft": root / "peft", "merged": root / "merged"}
    assert main(["convert", "--to-hf", str(run), "--out", str(paths["hf"])]) == 0
    assert main(["convert", "--to-peft", str(lora_run), "--out", str(paths["peft"]), "--base", str(paths["hf"])]) == 0
    assert main(["convert", "--to-hf", str(lora_run), "--merge", "--out", str(paths["merged"])]) == 0
    return paths


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


IDS = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))


def test_peft_loads_the_exported_adapter_with_tlms_logits(lora_run: Path, exported: dict[str, Path], record_error):
    config = json.loads((exported["peft"] / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == str(exported["hf"].resolve())
    base = transformers.AutoModelForCausalLM.from_pretrained(exported["hf"])
    wrapped = peft.PeftModel.from_pretrained(base, exported["peft"]).eval()
    ours, _ = artifacts.load_model(artifacts.resolve(lora_run))  # the base with the adapters merged
    with torch.no_grad():
        theirs, mine = wrapped(input_ids=IDS).logits, ours(IDS)
        merged = transformers.AutoModelForCausalLM.from_pretrained(exported["merged"]).eval()(IDS).logits
        plain_base = base.eval()
        with wrapped.disable_adapter():
            base_logits = plain_base(IDS).logits
    assert rel_err(base_logits, theirs) > 1e-3  # the adapters change the model, so the match below means something
    record_error("tlm LoRA run (merged) vs peft on the HF export, logits", mine, theirs)
    record_error("convert --to-hf --merge vs peft, logits", merged, theirs)
    assert rel_err(mine, theirs) < 1e-5
    assert rel_err(merged, theirs) < 1e-5
    # A PEFT adapter folder beside its base is a model for every command (merged here too).
    from_peft, _ = artifacts.load_model(artifacts.resolve(exported["peft"]))
    with torch.no_grad():
        assert rel_err(from_peft(IDS), theirs) < 1e-5


def test_commands_take_a_lora_run_and_a_peft_folder(run, lora_run, exported, corpus, capsys):
    losses = []
    for checkpoint in (lora_run, exported["peft"], exported["merged"]):
        argv = ["eval", "--checkpoint", str(checkpoint), "--data", str(corpus), "--max-tokens", "400", "--json"]
        assert main([*argv, "--quiet"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] == pytest.approx(losses[2], rel=1e-5)
    assert main(["info", "--checkpoint", str(exported["peft"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "PEFT adapter folder"
    assert main(["info", "--checkpoint", str(lora_run), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert lora == {"rank": 4, "alpha": 8.0, "targets": ALL, "dropout": 0.0, "base": str(run.resolve())}
    # Greedy continuations agree between the run and its PEFT export, both read merged.
    texts = []
    for checkpoint in (lora_run, exported["peft"]):
        argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "The ", "--max-new-tokens", "6"]
        assert main([*argv, "--temperature", "0", "--json", "--quiet"]) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1]


def test_a_peft_adapter_folder_is_an_init_from(exported: dict[str, Path], corpus: Path, tmp_path: Path):
    argv = ["train", "--init-from", str(exported["peft"]), "--data", str(corpus), "--out-dir", str(tmp_path / "ft"),
            "--steps", "1", "--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    start, _ = artifacts.load_model(artifacts.resolve(exported["peft"]))
    assert artifacts.model_config(artifacts.resolve(tmp_path / "ft")) == start.config


def test_lora_conversions_refuse_what_they_cannot_do(run: Path, lora_run: Path, tmp_path: Path, fails):
    fails(["convert", "--to-hf", str(lora_run), "--out", str(tmp_path / "x")], "holds LoRA adapters", "--merge")
    fails(["convert", "--to-hf", str(run), "--merge", "--out", str(tmp_path / "x")], "no LoRA adapters to merge")
    fails(["convert", "--to-peft", str(run), "--out", str(tmp_path / "x")], "no LoRA adapters")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    fails(["convert", "--to-peft", str(lora_run), "--out", str(tmp_path / "mine")], "holds other files")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_lora_rank_is_a_sweepable_setting(run: Path, corpus: Path, tmp_path: Path):
    from tlm_train import RunDir

    sets = {"init_from": run, "data": corpus, "steps": 2, "batch_size": 4, "eval_batches": 1, "peak_flops": 1e9,
            "sample_tokens": 0, "eval_interval": 2, "checkpoint_interval": 2}  # fmt: skip
    argv = ["sweep", "--out-dir", str(tmp_path / "sweep"), "--grid", "lora_rank=2,4", "--quiet"]
    assert main([*argv, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]) == 0
    for rank in (2, 4):
        state = RunDir(tmp_path / "sweep" / f"lora_rank={rank}").checkpoints().load(2).state
        assert state["lora"]["rank"] == rank
        assert state["model"]["layers.0.attn.q_proj.lora_A.default"].shape == (rank, 32)


def test_an_adapter_peft_itself_saved_opens_with_peft_logits(exported: dict[str, Path], tmp_path: Path, record_error):
    base = transformers.AutoModelForCausalLM.from_pretrained(exported["hf"])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.1)
    wrapped = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    wrapped.save_pretrained(tmp_path / "adapter")  # names the base by the path it was loaded from
    ours, _ = artifacts.load_model(artifacts.resolve(tmp_path / "adapter"))
    with torch.no_grad():
        theirs, mine = wrapped.eval()(input_ids=IDS).logits, ours(IDS)
    record_error("a PEFT-saved adapter read by tlm vs peft, logits", mine, theirs)
    assert rel_err(mine, theirs) < 1e-5
    # What tlm cannot reproduce is refused by name rather than loaded wrong.
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**saved, "use_dora": True}))
    with pytest.raises(ValueError, match=r"PEFT options tlm does not reproduce: \['use_dora'\]"):
        artifacts.load_model(artifacts.resolve(tmp_path / "adapter"))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: "[1, 2]", "holds a JSON list, not an adapter config"),
        (lambda c: "{not json", "is not readable JSON"),
        (lambda c: json.dumps({**c, "r": 0}), "r must be a positive int"),
        (lambda c: json.dumps({**c, "target_modules": ["embed_tokens"]}), "['embed_tokens'] are not Llama projections"),
        (lambda c: json.dumps({**c, "base_model_name_or_path": "nowhere"}), "its base model nowhere is not there"),
    ],
)
def test_a_damaged_peft_folder_is_one_line_naming_it(exported, tmp_path, fails, change, words):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(exported["peft"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(change(config))
    fails(["generate", "--checkpoint", str(folder), "--prompt-ids", "1 2", "--max-new-tokens", "1"], words)


@pytest.mark.slow  # a chat base, a LoRA run and its resume, three exports: ~8 s on the 2-core machine
def test_a_lora_chat_fine_tune_resumes_exports_and_serves_with_its_template(tmp_path: Path):
    import shutil

    from tlm_command.serve import _chat_template
    from tlm_tokenizer import Tokenizer
    from tlm_tokenizer.chat import ChatTemplate
    from tlm_train import RunDir

    conversation = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": " four"}]
    records = [{"prompt": f"question {i} about cats", "completion": f"answer {i}: dogs"} for i in range(30)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*records, *[{"messages": conversation}] * 4]))
    small = ["--data", str(data), "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e9",
             "--warmup-steps", "1", "--sample-tokens", "0", "--quiet"]  # fmt: skip
    shape = ["--vocab-size", "300", "--context-length", "32", "--d-model", "32", "--num-layers", "1",
             "--num-heads", "2", "--d-ff", "64"]  # fmt: skip
    base, lora, resumed = tmp_path / "base", tmp_path / "lora", tmp_path / "resumed"
    assert main(["train", *small, *shape, "--steps", "2", "--out-dir", str(base)]) == 0  # a chat model, markers in
    tune = ["--init-from", str(base), "--steps", "4", "--checkpoint-interval", "2", "--lora-rank", "4",
            "--lora-targets", "q,k,v,o,w1,w2,w3", "--lora-dropout", "0.1"]  # fmt: skip
    assert main(["train", *small, *tune, "--out-dir", str(lora)]) == 0
    shutil.copytree(lora, resumed)
    assert main(["train", "--resume", str(resumed / "checkpoints" / "step_00000002"), "--quiet"]) == 0
    got, want = (RunDir(r).checkpoints().load(4).state["model"] for r in (resumed, lora))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # bit-exact
    for argv in (["--to-hf", str(base), "--out", str(tmp_path / "hf")],
                 ["--to-peft", str(lora), "--out", str(tmp_path / "peft"), "--base", str(tmp_path / "hf")],
                 ["--to-hf", str(lora), "--merge", "--out", str(tmp_path / "merged")]):  # fmt: skip
        assert main(["convert", *argv]) == 0
    wrapped = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), tmp_path / "peft"
    ).eval()
    ours, _ = artifacts.load_model(artifacts.resolve(lora))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(ids), wrapped(input_ids=ids).logits) < 1e-5
    # The merged export's tokenizer applies the run's template as tlm does; tlm serve renders it for the LoRA
    # run and for the PEFT folder (whose tokenizer is the run's, written beside the adapter).
    tokenizer = Tokenizer.load(lora / "tokenizer")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    expected = list(hf_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False))
    assert ChatTemplate(tokenizer, tokenizer.chat_template).encode(conversation).ids == expected
    # The PEFT folder carries the run's tokenizer and template: an HF user applies it without the base's files.
    peft_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "peft")
    assert list(peft_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)) == expected
    for checkpoint in (lora, tmp_path / "peft"):
        artifact = artifacts.resolve(checkpoint)
        render = _chat_template(artifact, artifacts.load_tokenizer(artifact))
        assert render(conversation[:1]) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_to_peft_reports_as_json_or_in_one_line(lora_run: Path, exported: dict[str, Path], tmp_path: Path, capsys):
    from safetensors.torch import load_file

    argv = ["convert", "--to-peft", str(lora_run), "--base", str(exported["hf"])]
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "a"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    adapters = load_file(tmp_path / "a" / "adapter_model.safetensors")  # what peft reads
    assert report["parameters"] == sum(t.numel() for t in adapters.values()) > 0
    assert (report["out"], report["step"], report["lora"]["rank"], report["lora"]["alpha"]) == (
        str(tmp_path / "a"), 3, 4, 8.0)  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line == (f"LoRA run {lora_run} (step 3) -> PEFT adapter {tmp_path / 'b'} with its tokenizer for the base "
                    f"{exported['hf']} ({report['parameters']:,} adapter parameters)")  # fmt: skip


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_no_output_lands_on_or_in_the_base_a_peft_adapter_reads(exported, corpus: Path, tmp_path: Path, fails):
    import shutil

    hf, adapter = tmp_path / "hf", tmp_path / "peft"
    shutil.copytree(exported["hf"], hf)
    shutil.copytree(exported["peft"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(hf)}))
    before = _files(hf)
    for out in (hf, hf / "merged"):
        fails(["convert", "--to-hf", str(adapter), "--merge", "--out", str(out)], f"would overwrite the input {hf};")
    fails(["train", "--init-from", str(adapter), "--data", str(corpus), "--out-dir", str(hf / "ft"), "--steps", "1"],
          f"lies inside --init-from {hf}")  # fmt: skip
    assert _files(hf) == before


@pytest.mark.slow  # a LoRA run of one step on a copy of the base: ~3 s on the 2-core machine
def test_no_output_lands_on_or_in_the_base_a_lora_run_reads(run: Path, corpus: Path, tmp_path: Path, fails):
    import shutil

    base, lora = tmp_path / "base", tmp_path / "lora"
    shutil.copytree(run, base)
    argv = ["train", "--init-from", str(base), "--data", str(corpus), "--out-dir", str(lora), "--steps", "1",
            "--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0", "--lora-rank", "2",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    before = _files(base)
    for out in (base, base / "hf"):
        fails(["convert", "--to-hf", str(lora), "--merge", "--out", str(out)], f"would overwrite the input {base}")
        fails(["convert", "--to-peft", str(lora), "--out", str(out)], f"would overwrite the input {base}")
    fails(["train", "--init-from", str(lora), "--data", str(corpus), "--out-dir", str(base), "--steps", "1"],
          f"--out-dir {base} is --init-from {base.resolve()}")  # fmt: skip
    assert _files(base) == before


def test_to_peft_writes_the_runs_tokenizer_and_its_chat_template_beside_the_adapter(lora_run: Path, tmp_path: Path):
    import tlm_artifacts
    from tlm_tokenizer import Tokenizer

    # A template of plain text (the run's tokenizer has no chat markers), through --tokenizer.
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = Tokenizer.load(lora_run / "tokenizer")
    tokenizer.chat_template = template
    tokenizer.save(tmp_path / "tok")
    out = tmp_path / "peft"
    assert main(["convert", "--to-peft", str(lora_run), "--tokenizer", str(tmp_path / "tok"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(out)
    conversation = [{"role": "user", "content": "def f(x):\n    return x"}]
    text = hf.apply_chat_template(conversation, tokenize=False)
    assert text == "user: def f(x):\n    return x\n"
    assert list(hf.apply_chat_template(conversation, tokenize=True, return_dict=False)) == tokenizer.encode(text)
    # tlm reads the folder's own tokenizer too (its template), not the base's.
    assert tlm_artifacts.load_tokenizer(tlm_artifacts.resolve(out)).chat_template == template
    # A second export over the first replaces it (the tokenizer's files are the export's own).
    assert main(["convert", "--to-peft", str(lora_run), "--out", str(out)]) == 0
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())

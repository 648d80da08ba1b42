"""LoRA through the command: ``tlm train --lora-rank``, ``tlm convert --to-peft`` read by HF peft itself,
``--to-hf --merge`` read by transformers, and a LoRA run or a PEFT adapter folder as any command's model."""

import json
from pathlib import Path

import pytest
import torch

from tlm_command.main import main
from tlm_train import artifacts

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


def test_commands_take_a_lora_run_and_a_peft_folder(lora_run: Path, exported: dict[str, Path], corpus, capsys):
    losses = []
    for checkpoint in (lora_run, exported["peft"], exported["merged"]):
        argv = ["eval", "--checkpoint", str(checkpoint), "--data", str(corpus), "--max-tokens", "400", "--json"]
        assert main([*argv, "--quiet"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] == pytest.approx(losses[2], rel=1e-5)
    assert main(["info", "--checkpoint", str(exported["peft"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "PEFT adapter folder"
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

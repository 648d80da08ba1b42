"""``tlm convert``: between tlm checkpoints and Hugging Face Llama folders, tokenizer included.

``--to-hf X --out DIR`` writes ``config.json``, ``model.safetensors``, ``generation_config.json`` (with
``<|endoftext|>`` as end of sequence when the tokenizer has it) and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``), all as one unit: ``AutoModelForCausalLM``, ``AutoTokenizer`` and
``pipeline("text-generation")`` read DIR as it is. ``--from-hf DIR --out OUT`` writes a tlm model
folder (``OUT/model.safetensors``, and ``OUT/tokenizer/`` when tlm can reproduce the HF tokenizer, as one unit)
that every tlm command and ``tlm train --init-from`` read.

A LoRA run (``tlm train --lora-rank``): ``--to-peft RUN --out DIR`` writes its adapters as a PEFT adapter
(``adapter_config.json``, ``adapter_model.safetensors``) for the HF export of its base (``--to-hf BASE``), which
``peft.PeftModel.from_pretrained`` loads; ``--to-hf RUN --merge`` writes the base with the adapters merged in.

``--from-hf`` also reads Qwen2 (q/k/v biases; exported back as Qwen2) and Mistral folders; a sliding window
shorter than the context needs ``--context-length N`` within it. ``--to-gguf X --out FILE.gguf`` (the ``gguf``
extra) writes one GGUF file for llama.cpp and ollama, tokenizer and chat template included.
"""

import argparse
import json
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, add_command, check_output, dtype_choices
from tlm_command.loading import load_tokenizer
from tlm_tokenizer.chat import IM_END
from tlm_tokenizer.hf_json import EOS_TOKEN, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON

#: The tokenizer's files that --to-peft writes beside the adapter.
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG_JSON)


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands, "convert", "convert between a tlm checkpoint and an HF Llama folder (tokenizer included)", __doc__
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="an HF Llama model folder")
    direction.add_argument(
        "--to-hf", metavar="PATH", help="a run folder, step folder or model file (the run's newest checkpoint)"
    )
    direction.add_argument("--to-peft", metavar="RUN", help="a LoRA run (or step folder of one): its adapters for peft")
    direction.add_argument(
        "--to-gguf",
        metavar="PATH",
        help="a run folder, step folder, model file or HF folder: one GGUF file (--out FILE.gguf) for llama.cpp and "
        "ollama, its tokenizer included (needs the gguf extra)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="with --to-hf of a LoRA run or PEFT adapter: merge the adapters in"
    )
    parser.add_argument(
        "--base",
        metavar="DIR",
        help="with --to-peft: the base model the adapter names (base_model_name_or_path; default: the run's base)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (replaced as a whole)")
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="the tokenizer to export (default: the checkpoint's own; --to-peft too)"
    )
    parser.add_argument(
        "--dtype", choices=dtype_choices(), default=None, help="convert the weights (default: as stored)"
    )
    parser.add_argument(
        "--context-length",
        type=int,
        metavar="N",
        help="with --from-hf: import for a context of N tokens (default: the checkpoint's max_position_embeddings; "
        "a Mistral or Qwen2 whose sliding window is shorter needs N within the window)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(run=run)


def hf_files(tokenizer: Any) -> dict[str, bytes]:
    """The tokenizer's files for an HF folder, and a generation config that ends at ``<|endoftext|>``.

    Without an end-of-text token the generation config says so with explicit nulls: left out,
    transformers would fall back to LlamaConfig's bos 1 and eos 2, which mean nothing to a tlm tokenizer."""
    from tlm_model.interop import hf_generation_config

    files: dict[str, bytes] = {}
    generation: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer is not None:
        files.update(tokenizer.hf_files())
        if EOS_TOKEN in tokenizer.special_tokens:
            (eos,) = tokenizer.encode(EOS_TOKEN)
            # A chat model ends its turn with <|im_end|>: generation stops there too.
            ends = [eos, *(tokenizer.encode(IM_END) if IM_END in tokenizer.special_tokens else [])]
            generation = hf_generation_config(ends if len(ends) > 1 else eos, bos_token_id=eos, pad_token_id=eos)
    files["generation_config.json"] = (json.dumps({**generation, "do_sample": False}, indent=2) + "\n").encode()
    return files


def run(args: argparse.Namespace) -> int:
    import tlm_artifacts
    from tlm_artifacts.inputs import read_paths
    from tlm_core.tensors import dtype_from_name
    from tlm_model import save_hf

    if args.context_length is not None and args.from_hf is None:
        raise UserError("--context-length goes with --from-hf (a model's context grows by training: tlm train "
                        "--init-from RUN --context-length N)")  # fmt: skip
    if args.to_peft is not None:
        return _to_peft(args)
    if args.to_gguf is not None:
        return _to_gguf(args)
    if args.base is not None:
        raise UserError("--base names the base of a PEFT adapter: it goes with --to-peft")
    source = args.from_hf if args.from_hf is not None else args.to_hf
    check_output(args.out, *read_paths(source), args.tokenizer)  # a LoRA run or PEFT adapter reads its base too
    if args.merge and args.to_hf is None:
        raise UserError("--merge goes with --to-hf (a LoRA run or PEFT adapter, merged into its base)")
    dtype = dtype_from_name(args.dtype) if args.dtype else None
    if args.from_hf is not None:
        artifact = tlm_artifacts.resolve(args.from_hf)
        if artifact.kind != "hf":
            raise UserError(
                f"--from-hf {args.from_hf} is a tlm {artifact.describe()}, not an HF folder (no config.json)"
            )
        context = {} if args.context_length is None else {"context_length": args.context_length}
        model, _ = tlm_artifacts.load_model(artifact, dtype=dtype, **context)
        tokenizer = load_tokenizer(args.tokenizer, artifact)
        _write_model_folder(Path(args.out), model, tokenizer)
        source_kind, target = "HF model folder", "tlm model folder"
    else:
        artifact = tlm_artifacts.resolve(args.to_hf)
        if artifact.kind == "hf":
            raise UserError(f"--to-hf {args.to_hf} is already an HF folder; to read it into tlm: tlm convert --from-hf")
        adapted = artifact.kind == "peft" or tlm_artifacts.lora_step(artifact) is not None
        if adapted and not args.merge:
            raise UserError(
                f"--to-hf {args.to_hf} holds LoRA adapters: add --merge to write its base with them merged in, or "
                "write the adapters themselves with --to-peft"
            )
        if args.merge and not adapted:
            raise UserError(f"--merge: {args.to_hf} is a tlm {artifact.describe()} with no LoRA adapters to merge")
        model, step = tlm_artifacts.load_model(artifact, dtype=dtype)
        tokenizer = load_tokenizer(args.tokenizer, artifact)
        from tlm_train.model_card import model_card

        card = {"README.md": model_card(model, tokenizer, artifact, step)}
        save_hf(model, args.out, extra_files={**hf_files(tokenizer), **card})
        source_kind, target = f"tlm {artifact.describe()}", f"HF {'Qwen2' if model.config.qkv_bias else 'Llama'} folder"
    report = {
        "from": source,
        "out": args.out,
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer is not None,
        "config": model.config.to_dict(),
    }
    _done(args, report, f"{source_kind} {source} -> {target} {args.out}")
    return 0


def _write_model_folder(out: Path, model: Any, tokenizer: Any) -> None:
    """``out/model.safetensors`` and ``out/tokenizer/`` as one unit (``tlm_core.atomic.replace_dir``): a kill or an
    error between the two leaves the old folder, never a new model beside the old tokenizer (or none). Without a
    tokenizer, an ``out`` ending in ``.safetensors`` is the model file itself."""
    from tlm_core.atomic import replace_dir
    from tlm_model import save_model_file

    if out.suffix == ".safetensors":
        if tokenizer is not None:
            raise UserError(f"--out {out} names one model file: the tokenizer needs a folder; give a folder")
        save_model_file(model, out)
        return
    ours = ("model.safetensors", "tokenizer")
    if out.is_dir() and (other := sorted(p.name for p in out.iterdir() if p.name not in ours)):
        raise UserError(f"--out {out} holds other files ({', '.join(other[:3])}): choose an empty or new folder")

    def fill(folder: Path) -> None:
        save_model_file(model, folder)
        if tokenizer is not None:
            tokenizer.save(folder / "tokenizer")

    replace_dir(out, fill)


def _to_peft(args: argparse.Namespace) -> int:
    """The adapters of a LoRA run as a PEFT adapter folder for the HF export of its base."""
    import os

    import torch

    import tlm_artifacts
    from tlm_artifacts.artifact import load_lora_step
    from tlm_artifacts.inputs import read_paths
    from tlm_artifacts.layout import PEFT_CONFIG, PEFT_WEIGHTS
    from tlm_artifacts.lora import adapter_bytes, peft_config
    from tlm_core.atomic import replace_dir
    from tlm_lora import lora_state_dict
    from tlm_model.interop import to_hf_lora_state_dict

    if args.merge or args.dtype is not None:
        raise UserError("--to-peft writes the adapters as trained: --merge and --dtype do not apply")
    check_output(args.out, *read_paths(args.to_peft), args.base, args.tokenizer)
    out_dir = Path(args.out)
    ours = (PEFT_CONFIG, PEFT_WEIGHTS, *TOKENIZER_FILES)
    if out_dir.is_dir() and (other := sorted(p.name for p in out_dir.iterdir() if p.name not in ours)):
        raise UserError(f"--out {args.out} holds other files ({', '.join(other[:3])}): choose an empty or new folder")
    artifact = tlm_artifacts.resolve(args.to_peft)
    found = tlm_artifacts.lora_step(artifact)
    if found is None:
        raise UserError(
            f"--to-peft {args.to_peft} is a tlm {artifact.describe()} with no LoRA adapters (see --lora-rank)"
        )
    folder, state = found
    base_config = tlm_artifacts.model_config(tlm_artifacts.resolve(state["lora"]["base"]["path"]))
    base_vocab = base_config.vocab_size
    tuned = state["model_config"]
    if (tuned["context_length"], tuned.get("rope_scaling")) != (base_config.context_length, base_config.rope_scaling):
        raise UserError(
            f"--to-peft {args.to_peft}: it extended the base's context ({base_config.context_length} tokens, RoPE "
            f"scaling {base_config.rope_scaling}) to {tuned['context_length']} ({tuned.get('rope_scaling')}), which a "
            "PEFT adapter of the base cannot carry; export the merged model with --to-hf --merge"
        )
    if state["model_config"]["vocab_size"] != base_vocab:
        raise UserError(
            f"--to-peft {args.to_peft}: its vocabulary grew from the base's {base_vocab} to "
            f"{state['model_config']['vocab_size']} ids (a chat template's markers), which a PEFT adapter of the "
            "base cannot carry; export the merged model with --to-hf --merge"
        )
    # The run's tokenizer (its chat template included) beside the adapter: AutoTokenizer reads the folder as it is.
    tokenizer = load_tokenizer(args.tokenizer, artifact)
    tokenizer_files = {} if tokenizer is None else tokenizer.hf_files()
    if tokenizer is not None and tokenizer.vocab_size > base_vocab:
        raise UserError(
            f"--to-peft: the tokenizer has {tokenizer.vocab_size} ids, more than the base's {base_vocab}; export the "
            "merged model with --to-hf --merge"
        )
    model = load_lora_step(folder, state, dtype=torch.float32, merge=False)
    adapters = to_hf_lora_state_dict(lora_state_dict(model), model.config)
    base = os.path.abspath(args.base if args.base is not None else state["lora"]["base"]["path"])
    config = (json.dumps(peft_config(state["lora"], base), indent=2) + "\n").encode()

    def fill(out: Path) -> None:
        (out / PEFT_CONFIG).write_bytes(config)
        (out / PEFT_WEIGHTS).write_bytes(adapter_bytes(adapters))
        for name, data in tokenizer_files.items():
            (out / name).write_bytes(data)

    replace_dir(out_dir, fill)
    report = {
        "from": args.to_peft,
        "out": args.out,
        "step": state["step"],
        "base": base,
        "parameters": sum(t.numel() for t in adapters.values()),
        "tokenizer": tokenizer is not None,
        "lora": {k: v for k, v in state["lora"].items() if k != "base"},
    }
    if args.json:
        print(json.dumps(report))
    else:
        with_tokenizer = " with its tokenizer" if tokenizer is not None else ""
        print(f"LoRA run {args.to_peft} (step {state['step']}) -> PEFT adapter {args.out}{with_tokenizer} for the "
              f"base {base} ({report['parameters']:,} adapter parameters)")  # fmt: skip
    return 0


def gguf_vocabulary(tokenizer: Any) -> Any:
    """``tokenizer`` (a tlm byte-level BPE) as a :class:`tlm_model.gguf.GGUFVocabulary`: the tokens and merges of
    its ``tokenizer.json`` (GPT-2's byte-level text), its special tokens as control tokens, ``<|endoftext|>`` as
    the end of a sequence, and its chat template."""
    from tlm_model.gguf import GGUFVocabulary

    document = json.loads(tokenizer.hf_files()["tokenizer.json"])
    by_id = {index: text for text, index in document["model"]["vocab"].items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise UserError("--to-gguf: the tokenizer's ids are not 0..n-1, which GGUF's token list needs")
    special = frozenset(token["id"] for token in document["added_tokens"])
    eos = tokenizer.encode(EOS_TOKEN)[0] if EOS_TOKEN in tokenizer.special_tokens else None
    return GGUFVocabulary(
        tokens=[by_id[i] for i in range(len(by_id))],
        merges=document["model"]["merges"],
        special=special,
        eos_token_id=eos,
        chat_template=tokenizer.chat_template,
    )


def _to_gguf(args: argparse.Namespace) -> int:
    """A model as one GGUF file (llama.cpp's ``llama``, or ``qwen2`` with q/k/v biases), tokenizer included."""
    import tlm_artifacts

    try:
        from tlm_model.gguf import GGUF_DTYPES, save_gguf
    except ModuleNotFoundError as err:
        raise UserError(f"--to-gguf needs the gguf library ({err}): pip install 'tlm-command[gguf]'") from None
    if args.base is not None:
        raise UserError("--base names the base of a PEFT adapter: it goes with --to-peft")
    if args.dtype is not None and args.dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype {args.dtype}: a GGUF export takes one of {', '.join(GGUF_DTYPES)}")
    check_output(args.out, args.to_gguf, args.tokenizer)
    artifact = tlm_artifacts.resolve(args.to_gguf)
    adapted = artifact.kind == "peft" or tlm_artifacts.lora_step(artifact) is not None
    if adapted and not args.merge:
        raise UserError(
            f"--to-gguf {args.to_gguf} holds LoRA adapters: add --merge to write its base with them merged in"
        )
    if args.merge and not adapted:
        raise UserError(f"--merge: {args.to_gguf} is a {artifact.describe()} with no LoRA adapters to merge")
    model, _ = tlm_artifacts.load_model(artifact)
    tokenizer = load_tokenizer(args.tokenizer, artifact)
    stored = str(model.lm_head.weight.dtype).removeprefix("torch.")
    dtype = args.dtype if args.dtype is not None else stored if stored in GGUF_DTYPES else "float32"
    vocabulary = None if tokenizer is None else gguf_vocabulary(tokenizer)
    save_gguf(model, args.out, dtype=dtype, vocabulary=vocabulary, name=Path(args.to_gguf).resolve().name)
    arch = "qwen2" if model.config.qkv_bias else "llama"
    report = {
        "from": args.to_gguf,
        "out": args.out,
        "architecture": arch,
        "dtype": dtype,
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer is not None,
        "config": model.config.to_dict(),
    }
    _done(args, report, f"{artifact.describe()} {args.to_gguf} -> GGUF ({arch}, {dtype}) {args.out}")
    return 0


def _done(args: argparse.Namespace, report: dict[str, Any], what: str) -> None:
    """A conversion's report: JSON with ``--json``, else one line, ``what`` then its tokenizer and size."""
    if args.json:
        print(json.dumps(report))
        return
    from tlm_model.accounting import human

    with_tokenizer = " with its tokenizer" if report["tokenizer"] else " (no tokenizer)"
    print(f"{what}{with_tokenizer} ({human(report['parameters'])} parameters)")

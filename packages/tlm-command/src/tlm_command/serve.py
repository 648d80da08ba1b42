"""``tlm serve``: an OpenAI-compatible HTTP server for a model, with streaming and continuous batching.

Serves ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``:
server-sent events ending with ``data: [DONE]``) and ``GET /health`` on 127.0.0.1 unless ``--host``
says otherwise; any OpenAI client works against ``http://HOST:PORT/v1``. One scheduler thread owns the
model: every step is one batched forward for every request in flight, and requests join and leave
between steps. A greedy request (``temperature: 0``) gets exactly what ``tlm generate --temperature 0``
prints; a request with a ``seed`` gets the same tokens whatever shares its batch. A prompt that does
not fit the context with its ``max_tokens`` is refused (400), never slid. Past ``--max-batch`` requests
in flight, requests wait in a queue of ``--max-queue``; past that the answer is 429 with Retry-After.
SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for up to
``--drain-timeout`` seconds, and exits 0.

Every value a request sends is checked when it arrives (a body over ``--max-body`` bytes is 413), so none can
stop the server; what one request still raises while decoding ends that request alone, and only a failure of
the model makes ``/health`` 503. Scoring is OpenAI's ``logprobs``/``echo`` (lm-evaluation-harness's
``local-completions`` uses them). Each request is one line on stderr (``--quiet``: none).

Chat prompts use the tokenizer's own chat template when the artifact has one (an HF folder's
``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``, rendered with jinja2); otherwise
the plain template for base models: one "Role: content" line per message, then "Assistant:", with
"\\nUser:" as a stop text. A template is rendered on a probe conversation at start; one that fails stops
the command with one line. Needs the ``serve`` extra: ``pip install 'tlm-command[serve]'``.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tlm_command.args import UserError, add_command, add_device_arguments, positive_int, utf8_text

#: What the serve extra installs, by import name (for the message when one is missing).
SERVE_MODULES = ("fastapi", "uvicorn")


def add_parser(commands: Any) -> None:
    from tlm_command.loading import add_model_arguments

    parser = add_command(
        commands, "serve", "serve a model over HTTP with OpenAI's API (streaming, continuous batching)", __doc__
    )
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--model-name", default=None, help="the model id clients name (default: the checkpoint's name)")
    parser.add_argument("--max-batch", type=positive_int, default=16, metavar="N", help="requests decoded together")
    parser.add_argument(
        "--max-queue", type=positive_int, default=64, metavar="N", help="requests waiting for a row; then 429"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="S", help="on SIGTERM, seconds to finish requests"
    )
    parser.add_argument(
        "--max-body", type=positive_int, default=None, metavar="BYTES",
        help="a request body's bytes at most; larger ones get 413 (default: 1 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-chunk", type=positive_int, default=None, metavar="N",
        help="prompt tokens in one prefill forward at most: what a request arriving during a long prompt waits "
        "for (default: 32 on a CPU, 512 on CUDA)",
    )  # fmt: skip
    parser.add_argument(
        "--token-budget", type=positive_int, default=None, metavar="N",
        help="prompt tokens prefilled between two decoding steps at most (default: 128 on a CPU, 2048 on CUDA)",
    )  # fmt: skip
    parser.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false",
        help="run every prompt whole (default: a prompt reuses the keys and values of the longest prefix it shares "
        "with a prompt run before, kept in --max-batch more cache rows)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no access log (one stderr line per request)")
    parser.add_argument(
        "--no-compile", action="store_true",
        help="decode with the eager model only (default: serve with it at once while the compiled engine warms "
        "up in the background, then switch to it between two steps; /health says which engine serves)",
    )  # fmt: skip
    add_device_arguments(parser, "weights' dtype (default: the checkpoint's)")
    parser.set_defaults(run=run)


#: The conversation a chat template is rendered on at start: one that any template takes.
PROBE_CONVERSATION = [{"role": "user", "content": "Hello"}]


def _chat_template(artifact: Any, tokenizer: Any) -> Any:
    """The artifact's own chat template as ``messages -> text``, or None when it has none. The template is
    compiled and rendered on :data:`PROBE_CONVERSATION` here: one that fails is the checkpoint's error (one line,
    exit 2), never a request's."""
    folder = artifact.tokenizer_path if artifact.tokenizer_path is not None else artifact.model_path
    folder = folder if folder.is_dir() else folder.parent
    from tlm_core.atomic import read_input

    source, where = None, folder
    try:  # through the checked read: a FIFO or device under the name is refused, never waited on
        if (folder / "chat_template.jinja").exists():
            where = folder / "chat_template.jinja"
            source = read_input(where, "chat template").decode("utf-8")
        elif (folder / "tokenizer_config.json").exists():
            where = folder / "tokenizer_config.json"
            config = json.loads(read_input(where, "tokenizer config"))
            source = config.get("chat_template") if isinstance(config, dict) else None
            source = source if isinstance(source, str) else None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{where}: not UTF-8 text or not JSON ({err})") from None
    if source is None:
        return None
    from tlm_tokenizer.chat import compile_template, render_time_limit

    try:  # as transformers renders templates (sandboxed, whitespace kept as written), with bounds on the work
        template = compile_template(source)
    except ValueError as err:
        if "needs jinja2" in str(err):
            raise UserError(
                f"{folder} has a chat template, which needs jinja2: pip install 'tlm-command[serve]'"
            ) from None
        raise UserError(f"{where}: the chat template does not compile: {err}") from None
    specials = {"bos_token": "", "eos_token": "<|endoftext|>" if "<|endoftext|>" in tokenizer.special_tokens else ""}

    def render(messages: list[dict[str, str]]) -> str:
        return template(messages=messages, add_generation_prompt=True, **specials)

    try:
        with render_time_limit(str(where)):
            render(PROBE_CONVERSATION)
    except Exception as err:
        raise UserError(f"{where}: the chat template fails on a one-message conversation: "
                        f"{type(err).__name__}: {err}") from None  # fmt: skip
    return render


def stop_tokens(tokenizer: Any) -> list[str]:
    """The special tokens that end every answer: ``<|endoftext|>``, and ``<|im_end|>``, the end of a chat
    model's turn (the ChatML template's marker), where the tokenizer has them."""
    from tlm_tokenizer.chat import IM_END
    from tlm_tokenizer.hf_json import EOS_TOKEN

    return [s for s in (EOS_TOKEN, IM_END) if s in tokenizer.special_tokens]


def model_id(checkpoint: str, model_name: str | None) -> str:
    """The model id clients name: ``--model-name``, else the checkpoint folder's own name (after links)."""
    if model_name is not None:
        return utf8_text("--model-name", model_name)
    # A folder's name may hold bytes that are not UTF-8: shown escaped ("run\\xff"), as every answer must encode.
    return os.fsencode(Path(checkpoint).resolve().name).decode("utf-8", "backslashreplace")


def run(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_MODULES if _missing(name)]
    if missing:
        raise UserError(f"tlm serve needs {' and '.join(missing)}: pip install 'tlm-command[serve]'")
    _check_flags(args)
    import signal
    import socket

    import uvicorn

    from tlm_command.args import inference_device
    from tlm_command.loading import load_model
    from tlm_command.openai_api import MAX_BODY, create_app

    device = inference_device(args)
    model, tokenizer, artifact = load_model(args, device)
    if tokenizer is None:
        raise UserError(f"tlm serve needs a tokenizer: {args.checkpoint} has none; give --tokenizer DIR")
    chat_template = _chat_template(artifact, tokenizer)
    stops = stop_tokens(tokenizer)
    eos_ids = [tokenizer.encode(s)[0] for s in stops]
    name = model_id(args.checkpoint, args.model_name)
    # Bound before the model thread starts, so a taken port is one line and no thread is left behind.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None

    def log(line: str) -> None:
        print(f"tlm serve: {line}", file=sys.stderr, flush=True)

    scheduler = _scheduler(args, model, tokenizer, eos_ids, device, log, sock)
    app = create_app(
        scheduler,
        tokenizer,
        model_name=name,
        context_length=model.config.context_length,
        chat_template=chat_template,
        default_stops=stops,
        vocab_size=model.config.vocab_size,
        max_body=args.max_body or MAX_BODY,
        access_log=not args.quiet,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not app.state.draining:  # the first signal; a second one makes uvicorn stop without waiting
                log(f"{signal.Signals(sig).name}: refusing new requests, finishing the {scheduler.active} running and "
                    f"{scheduler.waiting} waiting (at most --drain-timeout {args.drain_timeout:g} s)")  # fmt: skip
            app.state.draining = True  # /health says 503 and new requests are refused while the rest finish
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=args.drain_timeout, lifespan="off", access_log=False
    )
    server = Server(config)
    host, port = sock.getsockname()[:2]
    engine = "eager engine" if args.no_compile else "eager engine until the compiled one has warmed up"
    weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(f"tlm serve: {name} on http://{host}:{port}/v1 (max batch {args.max_batch}, {device.type} {weights}, "
          f"{engine})", file=sys.stderr, flush=True)  # fmt: skip
    if not args.no_compile:
        scheduler.compile_in_background()
    # uvicorn re-raises the signal that stopped it once it has drained, under the handler found before it
    # ran: for SIGTERM that handler is this no-op, so a drained server exits 0 (Ctrl-C still exits 130).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[sock])
    finished = scheduler.close(timeout=max(args.drain_timeout, 0.1))
    print(f"tlm serve: stopped{'' if finished else ' (requests still running were cut)'}", file=sys.stderr, flush=True)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The flags no loader checks, refused by name before anything loads."""
    # An empty --host binds every interface (what 0.0.0.0 says out loud); an empty model id no client can name.
    for flag, value in (("--host", args.host), ("--model-name", args.model_name)):
        if value is not None and not value.strip():
            raise UserError(
                f"{flag} is empty; give {'an address (0.0.0.0: every interface)' if flag == '--host' else 'a name'}"
            )
    if args.model_name is not None:
        utf8_text("--model-name", args.model_name)  # every answer carries it: one that cannot encode fails them all
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if not args.drain_timeout >= 0:
        raise UserError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")


def _scheduler(args: argparse.Namespace, model: Any, tokenizer: Any, eos_ids: list[int], device: Any,
               log: Any, sock: Any) -> Any:  # fmt: skip
    """The scheduler of ``--max-batch`` rows; a KV cache the device cannot hold is one line (``sock`` closed)."""
    import torch

    from tlm_model.scheduler import Scheduler

    try:
        return Scheduler(
            model, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue, eos_ids=eos_ids, device=device,
            prefill_chunk=args.prefill_chunk, token_budget=args.token_budget, prefix_cache=args.prefix_cache, log=log,
        )  # fmt: skip
    except (RuntimeError, MemoryError) as err:
        # The KV cache is allocated whole for --max-batch rows at start: too many rows is the user's setting, and a
        # traceback from the allocator names none (torch.OutOfMemoryError on CUDA, a RuntimeError on the CPU).
        if not (isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "allocate" in str(err)):
            raise
        sock.close()
        raise UserError(f"--max-batch {args.max_batch}: the KV cache of that many rows of "
                        f"{model.config.context_length} tokens does not fit the {device.type} memory; lower "
                        "--max-batch") from None  # fmt: skip


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None

"""``tlm serve``'s behaviours that a mutation sample found unpinned: the finish reason of a request that ends on
end-of-text, the defaults of ``max_tokens``, and the draining state after SIGTERM (503 with ``Retry-After``, on
``/health`` too).

The app runs in this process under uvicorn on 127.0.0.1, queried over real HTTP with ``http.client``. Its model
is built so that what it says is known in advance: every token embeds to the same vector and the blocks add
nothing, so the next-token logits are the same at every position, and the head gives one chosen id the only
positive logit; greedy decoding then says that id every time.
"""

import asyncio
import http.client
import json
import signal
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="tlm serve needs the serve extra (fastapi, uvicorn)")

CONTEXT = 64
EOT = "<|endoftext|>"


def constant_model(token_id: int):
    """A TransformerLM over a byte-level vocabulary (256 bytes, then end-of-text as 256) that always says
    ``token_id``."""
    from tlm_model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=257, context_length=CONTEXT, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        model.token_embeddings.weight.fill_(1.0)
        model.layers[0].attn.output_proj.weight.zero_()  # the blocks add nothing to the residual stream
        model.layers[0].ffn.w2.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0  # its logit: the normalised all-ones vector summed, > 0
    return model


def byte_tokenizer():
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])
    assert tokenizer.encode(EOT) == [256]
    return tokenizer


class InProcessServer:
    """``create_app`` over a real scheduler, served by uvicorn in a thread on a free port."""

    def __init__(self, says: int) -> None:
        import uvicorn

        from tlm_command.openai_api import create_app
        from tlm_model.scheduler import Scheduler

        tokenizer = byte_tokenizer()
        self.scheduler = Scheduler(constant_model(says), tokenizer, max_batch=4, max_queue=4, eos_ids=[256],
                                   device=torch.device("cpu"))  # fmt: skip
        self.app = create_app(self.scheduler, tokenizer, model_name="tiny", context_length=CONTEXT,
                              chat_template=None, default_stops=[EOT])  # fmt: skip
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn never started"
            time.sleep(0.01)

    def request(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, payload, dict(response.getheaders())

    def post(self, path, body):
        status, payload, headers = self.request("POST", path, body)
        return status, json.loads(payload), headers

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.close(timeout=5)


@pytest.fixture(scope="module")
def says_end_of_text():
    server = InProcessServer(says=256)
    yield server
    server.close()


@pytest.fixture(scope="module")
def says_a():
    server = InProcessServer(says=ord("a"))
    yield server
    server.close()


def test_a_request_that_meets_end_of_text_finishes_with_stop_and_without_its_text(says_end_of_text):
    body = {"prompt": "hello", "max_tokens": 20, "temperature": 0}
    status, answer, _ = says_end_of_text.post("/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["text"] == ""
    assert answer["usage"]["completion_tokens"] == 1  # the end-of-text token itself, then nothing

    status, payload, _ = says_end_of_text.request("POST", "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events) == ""

    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    status, answer, _ = says_end_of_text.post("/v1/chat/completions", chat)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"] == "" and EOT not in json.dumps(answer)


def test_a_request_that_never_meets_end_of_text_runs_to_its_length(says_a):
    # The contrast to the test above: the same server code, a model that never says end-of-text.
    status, answer, _ = says_a.post("/v1/completions", {"prompt": "hello", "max_tokens": 5, "temperature": 0})
    assert status == 200 and answer["choices"][0] == {"index": 0, "text": "aaaaa", "finish_reason": "length",
                                                       "logprobs": None}  # fmt: skip


def test_max_tokens_defaults_to_16_for_completions_and_to_the_context_left_for_chat(says_a):
    # OpenAI's defaults: 16 for the legacy completions, "as many as fit" for chat.
    status, answer, _ = says_a.post("/v1/completions", {"prompt": "hello", "temperature": 0})
    assert status == 200 and answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    assert answer["choices"][0]["text"] == "a" * 16 and answer["choices"][0]["finish_reason"] == "length"

    messages = [{"role": "user", "content": "hi"}]
    prompt_tokens = len(b"User: hi\nAssistant:")  # the plain chat template, one token per byte
    status, answer, _ = says_a.post("/v1/chat/completions", {"messages": messages, "temperature": 0})
    assert status == 200, answer
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": CONTEXT - prompt_tokens,
                               "total_tokens": CONTEXT}  # fmt: skip
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_draining_server_answers_503_with_retry_after_and_health_is_not_ok(says_a):
    from tlm_command.openai_api import RETRY_AFTER_S

    status, payload, _ = says_a.request("GET", "/health")
    assert status == 200 and json.loads(payload)["status"] == "ok"
    says_a.app.state.draining = True  # what SIGTERM sets (the next test shows it does)
    try:
        status, payload, headers = says_a.request("GET", "/health")
        assert status == 503 and json.loads(payload) == {"status": "unavailable"}
        assert headers["retry-after"] == str(RETRY_AFTER_S)
        for path, body in [("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:  # fmt: skip
            status, answer, headers = says_a.post(path, body)
            assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S), answer
            assert answer["error"]["type"] == "server_error" and "shutting down" in answer["error"]["message"]
    finally:
        says_a.app.state.draining = False
    assert says_a.request("GET", "/health")[0] == 200


def test_sigterm_puts_tlm_serve_s_app_in_the_draining_state(tmp_path, monkeypatch):
    # tlm serve itself, with uvicorn's run replaced by what uvicorn does on SIGTERM: call handle_exit.
    import uvicorn

    from tlm_command.main import main
    from tlm_model import save_model_file

    folder = tmp_path / "ckpt"
    save_model_file(constant_model(ord("a")), folder)
    byte_tokenizer().save(folder / "tokenizer")
    seen = {}

    def run(self, sockets=None):
        seen["before"] = self.config.app.state.draining
        self.handle_exit(signal.SIGTERM, None)
        seen["after"] = self.config.app.state.draining

    monkeypatch.setattr(uvicorn.Server, "run", run)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "--checkpoint", str(folder), "--port", "0", "--device", "cpu", "--no-compile"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)  # tlm serve sets its own
    assert seen == {"before": False, "after": True}


def test_the_scheduler_ends_a_request_on_an_end_of_text_id_without_a_stop_text():
    # The server also passes end-of-text as a stop text; the scheduler alone must stop on the id.
    from tlm_model.scheduler import Request, Scheduler

    scheduler = Scheduler(constant_model(256), byte_tokenizer(), max_batch=2, max_queue=2, eos_ids=[256],
                          device=torch.device("cpu"))  # fmt: skip
    emitted, done = [], threading.Event()

    def emit(piece):
        emitted.append((piece.text, piece.finish_reason))
        if piece.finish_reason is not None:
            done.set()

    request = Request(prompt=[104, 105], max_tokens=20, emit=emit, temperature=0.0, stop=[])
    try:
        scheduler.submit(request)
        assert done.wait(30), emitted
    finally:
        scheduler.close(timeout=5)
    assert emitted == [("", "stop")] and request.completion_tokens == 1


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
                                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                      "max_tokens": 3})])  # fmt: skip
def test_a_stream_is_served_as_server_sent_events(says_a, path, body):
    # OpenAI streams as server-sent events, whose MIME type is text/event-stream (the HTML standard's section on
    # them); clients such as the openai library's and EventSource read the stream by it.
    status, payload, headers = says_a.request("POST", path, {**body, "stream": True, "temperature": 0})
    assert status == 200 and headers["content-type"].split(";")[0] == "text/event-stream"
    assert payload.decode().rstrip().endswith("data: [DONE]")

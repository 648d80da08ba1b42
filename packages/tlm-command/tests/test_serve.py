"""``tlm serve`` as a real server process on 127.0.0.1, queried with the official ``openai`` client and with raw HTTP.

References are independent of the server: the text ``tlm generate`` gives the same prompt (the command run
in-process with ``--json``) and OpenAI's wire format as the ``openai`` client parses it. One server serves the
module; the last test stops it with SIGTERM.
"""

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai", reason="the openai client is in tlm-command's test extra")
pytest.importorskip("fastapi", reason="tlm serve needs the serve extra (fastapi, uvicorn)")

# Not marked slow: one server process for the module (seconds), and the only place requests meet a real uvicorn.

#: A random model with room for long generations (the disconnect test needs many steps), the tokenizer trained
#: on the shared corpus beside it.
CONTEXT = 384


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus):
    from tlm_model import ModelConfig, TransformerLM, save_model_file
    from tlm_tokenizer import Tokenizer, train_bpe

    folder = tmp_path_factory.mktemp("serve") / "tiny"
    vocab, merges = train_bpe(corpus, 320, ["<|endoftext|>"], num_workers=1)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=320, context_length=CONTEXT, d_model=32, num_layers=2, num_heads=2,
                                      d_ff=64))  # fmt: skip
    save_model_file(model.eval(), folder)
    Tokenizer(vocab, merges, ["<|endoftext|>"]).save(folder / "tokenizer")
    return folder


class Server:
    def __init__(self, checkpoint, *extra):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tlm", "serve", "--checkpoint", str(checkpoint), "--port", "0", "--max-batch", "8",
             "--max-queue", "4", "--model-name", "tiny", "--no-compile", *extra],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        line = self.process.stderr.readline()  # "tlm serve: tiny on http://127.0.0.1:PORT/v1 (...)"
        assert " on http://127.0.0.1:" in line, line + self.process.stderr.read()
        # The rest of stderr (the access log) is read as it comes, so that the pipe never fills.
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        self.port = int(line.split("127.0.0.1:")[1].split("/")[0])
        self.url = f"http://127.0.0.1:{self.port}/v1"
        # The port is bound before that line; uvicorn listens on it once started (seconds on a busy machine).
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}): {self.log[-5:]}"
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.05)

    def request(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, json.loads(payload) if payload else None, dict(response.getheaders())

    def get(self, path):
        return self.request("GET", path)[:2]

    def post(self, path, body):
        return self.request("POST", path, body)


def _until(condition, seconds=60, what="the condition", pause=0.05):
    """``condition()``'s first true value, polled until ``seconds`` have passed (a busy machine may take seconds)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(pause)
    return value


@pytest.fixture(scope="module")
def server(checkpoint):
    server = Server(checkpoint)
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def tlm_generate(checkpoint, prompt, n, *extra):
    """What ``tlm generate --json`` says for ``prompt`` (the command itself, run in-process)."""
    import contextlib
    import io

    from tlm_command.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(n),
                     "--quiet", "--json", *extra]) == 0  # fmt: skip
    return json.loads(out.getvalue())


PROMPTS = ["def", "The quick brown fox", "x", "import os\nimport sys\n\ndef main(argv):\n    return",
           "Python is a programming language that lets you work quickly", "a b c d e f g", "class Foo:\n",
           "1 + 1 ="]  # fmt: skip


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, body = server.get("/health")
    assert status == 200 and body["status"] == "ok"


def test_eight_concurrent_greedy_requests_each_get_tlm_generates_text(server, client, checkpoint):
    steps_before = server.get("/health")[1]["steps"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0), PROMPTS)
        )
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        expected = tlm_generate(checkpoint, prompt, 24, "--temperature", "0")
        assert answer.choices[0].text == expected["text"], prompt
        assert answer.usage.prompt_tokens == len(expected["prompt_ids"])
        assert answer.usage.completion_tokens == len(expected["ids"])
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # The requests shared forwards: far fewer steps than one per token per request.
    assert server.get("/health")[1]["steps"] - steps_before < 8 * 24 // 2


def test_a_seeded_request_reproduces_and_is_tlm_generates_sample(client, checkpoint):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=1.0, seed=1234)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # alone and beside other requests
        others = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=20) for p in PROMPTS[:3]]
        first = client.completions.create(**kwargs).choices[0].text
        [f.result() for f in others]
    assert client.completions.create(**kwargs).choices[0].text == first
    expected = tlm_generate(checkpoint, "The quick brown fox", 20, "--temperature", "1", "--seed", "1234")
    assert first == expected["text"]


def test_streamed_completion_and_chat_equal_the_whole_answers(client):
    prompt = PROMPTS[3]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Python?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert parts[-1].choices == [] and parts[-1].usage.total_tokens == chat.usage.total_tokens


def test_plain_chat_template_is_the_documented_one(client, checkpoint):
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    expected = tlm_generate(checkpoint, "User: hi\nAssistant:", 8, "--temperature", "0", "--stop", "\nUser:",
                            "--stop", "<|endoftext|>")  # fmt: skip
    assert chat.choices[0].message.content == expected["text"]


def test_stop_texts_end_the_text_before_them_even_across_tokens(client, checkpoint):
    prompt = PROMPTS[4]
    reference = tlm_generate(checkpoint, prompt, 30, "--temperature", "0")
    from tlm_tokenizer import Tokenizer

    tokenizer = Tokenizer.load(checkpoint / "tokenizer")
    pieces = [tokenizer.decode([i]) for i in reference["ids"]]
    # A stop text made of the end of one token and the start of the next, found only once both came.
    at = next(i for i in range(2, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[at][-1] + pieces[at + 1][:1]
    text = "".join(pieces)
    for stops in (stop, [stop, "\u2603 never"]):
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stops)
        assert answer.choices[0].text == text[: text.find(stop)]
        assert answer.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]


def _error(status, body, code, fragment):
    assert status == code, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ('{"prompt": "x", "max_tokens": ', 400, "not valid JSON"),
        ("[1, 2]", 400, "body"),
        ({"prompt": "x", "max_tokns": 3}, 400, "unknown field 'max_tokns'"),
        ({"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": CONTEXT}, 400, f"maximum context length is {CONTEXT} tokens"),
        ({"prompt": "word " * CONTEXT, "max_tokens": 1}, 400, "maximum context length"),
        ({"prompt": "x", "temperature": -0.1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "stop": 3}, 400, "stop"),
        ({"prompt": [1, 99999]}, 400, "below the vocabulary size"),
        ({}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server, body, status, fragment):
    _error(*server.post("/v1/completions", body)[:2], status, fragment)
    assert server.get("/health")[0] == 200


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": "x", "seed": 2**64}, 400, "seed"),
        ({"prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
        ({"prompt": "ab\ud800"}, 400, "prompt: the text is not valid UTF-8"),
        ({"prompt": ["ok", "\udfffx"]}, 400, "prompt.1: the text is not valid UTF-8"),
        ({"prompt": "x", "stop": "\ud800"}, 400, "stop: the text is not valid UTF-8"),
        ({"prompt": [1] * (CONTEXT + 1)}, 400, "maximum context length"),
        ({"prompt": [[1, 2], [1] * (CONTEXT + 1)]}, 400, "prompt.1 has"),
        ({"prompt": "x" * 900_000}, 400, "characters, more than"),
        ({"prompt": [1] * 1_000_000}, 413, "--max-body"),
        ({"prompt": [[1, 2], []]}, 400, "prompt.1: the prompt is empty"),
        ({"prompt": [[1, 2], "x"]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools: function calling is not supported"),
        ({"prompt": "x", "functions": []}, 400, "functions"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "x", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"\u00b2": 5}}, 400, "logit_bias: keys must be token ids"),  # "²": no int
        ({"prompt": "x", "logit_bias": {"\u0661": 5}}, 400, "logit_bias: keys must be token ids"),  # an Arabic 1
        ({"prompt": "x", "logit_bias": {"9" * 5000: 5}}, 400, "logit_bias: keys must be token ids"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, 400, "it needs echo"),
        ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": float("nan")}, 400, "frequency_penalty"),
        ({"prompt": "x", "n": 1000}, 400, "n"),
        ({"prompt": ["x"] * 20}, 400, "prompts is more than"),
        ({"prompt": "x", "best_of": 2}, 400, "unknown field 'best_of'"),
        ({"prompt": "x", "suffix": "y"}, 400, "unknown field 'suffix'"),
        (b'{"prompt": "\xff"}', 400, "not valid JSON"),
        ("[" * 100_000, 400, "not valid JSON"),
        ('{"prompt": "x", "user": ' + "[" * 900 + "]" * 900 + "}", 400, "user: Input should be a valid string"),
    ],
)
def test_pathological_values_are_refused_by_name_before_any_work(server, body, status, fragment):
    _error(*server.post("/v1/completions", body)[:2], status, fragment)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": [{"role": "user", "content": "hi\udfff"}]}, "messages.0.content: the text is not valid UTF-8"),
        ({"messages": [{"role": "user", "content": "x" * 900_000}]}, "characters, more than"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs: needs logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}, "function_call"),
    ],
)
def test_pathological_chat_values_are_refused_by_name(server, body, fragment):
    _error(*server.post("/v1/chat/completions", body)[:2], 400, fragment)


def test_after_every_pathological_value_the_same_process_serves_normally(server, client, checkpoint):
    # Values the sampler could not take before: a temperature far below float32's range is greedy; the
    # ends of the generator's seed range are seeds.
    expected = tlm_generate(checkpoint, PROMPTS[1], 12, "--temperature", "0")["text"]
    tiny = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1e-300)
    assert tiny.choices[0].text == expected
    for seed in (2**64 - 1, -(2**63)):
        assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": seed})[0] == 200
    status, health = server.get("/health")
    assert status == 200 and health["status"] == "ok"
    answer = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected
    # The access log has a line for each request, with its tokens.
    usage = f"prompt_tokens={answer.usage.prompt_tokens} completion_tokens={answer.usage.completion_tokens} ttft="
    # The line is written once the answer's last byte is sent, then read by the fixture's thread.
    _until(lambda: any(line.startswith("tlm serve: POST /v1/completions 200 " + usage) for line in server.log),
           what=f"the access log's line with {usage}")  # fmt: skip
    assert any(line.startswith("tlm serve: POST /v1/completions 413 ") for line in server.log)


def test_bad_chat_requests(server):
    _error(*server.post("/v1/chat/completions", {"messages": []})[:2], 400, "messages")
    _error(*server.post("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})[:2], 400, "role")
    _error(*server.request("GET", "/v1/nothing")[:2], 404, "Not Found")


def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    before = server.get("/health")[1]["steps"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "x", "max_tokens": CONTEXT - 10, "temperature": 0, "stream": True, "stop": "never \u2603"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.sock.shutdown(2)  # the client goes away with the request far from done
    conn.close()
    health = _until(lambda: (h := server.get("/health")[1])["active"] == 0 and h)
    assert health["steps"] - before < CONTEXT - 10 - 5


def test_a_full_server_answers_429_with_retry_after_instead_of_queueing(server, checkpoint):
    # 8 rows and 4 waiting places (the fixture's --max-batch 8 --max-queue 4): of 13 long requests sent at
    # once, at least one finds no place. Closing the connections then frees every row. The end of text is
    # banned, so that no request ends early and frees a place.
    from tlm_tokenizer import Tokenizer

    eot = Tokenizer.load(checkpoint / "tokenizer").encode("<|endoftext|>", allowed_special="all")[0]
    body = json.dumps({"prompt": "x", "max_tokens": CONTEXT - 10, "temperature": 0, "stream": True,
                       "logit_bias": {str(eot): -100}})  # fmt: skip
    conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(13)]
    for conn in conns:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    responses = [conn.getresponse() for conn in conns]
    refused = [r for r in responses if r.status == 429]
    assert refused and all(r.status in (200, 429) for r in responses)
    for response in refused:
        assert response.getheader("Retry-After") == "1"
        _error(429, json.loads(response.read()), 429, "busy")
    for conn in conns:
        conn.sock.shutdown(2)
        conn.close()
    _until(lambda: server.get("/health")[1]["active"] == 0)
    assert server.get("/health")[1] == {**server.get("/health")[1], "active": 0, "waiting": 0}


def test_sigterm_finishes_requests_in_flight_then_exits_0(server):
    # The module's server, last: a long stream is in flight when SIGTERM comes. New connections are refused
    # while it finishes; it still ends with [DONE], and the process exits 0.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "x", "max_tokens": CONTEXT - 10, "temperature": 0, "stream": True, "stop": "never \u2603"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    server.process.send_signal(signal.SIGTERM)

    def refused():
        try:
            server.get("/health")
        except OSError:
            return True  # the listener is closed
        return False

    _until(refused, what="the server to stop accepting connections after SIGTERM", pause=0.01)
    # The server's own line, written when the signal came, says the stream was still running then (the stream
    # itself may end before this test looks again, on a busy machine).
    said = _until(lambda: [line for line in server.log if "SIGTERM" in line], what="the server's SIGTERM line")
    assert said[0].startswith("tlm serve: SIGTERM: refusing new requests, finishing the 1 running and 0 waiting")
    rest = response.read().decode()
    assert rest.rstrip().endswith("data: [DONE]")
    last = json.loads([line for line in rest.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["usage"]["completion_tokens"] == CONTEXT - 10 and last["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=30) == 0


def test_an_artifacts_own_chat_template_is_rendered_with_the_generation_prompt(tmp_path):
    from types import SimpleNamespace

    from tlm_command.serve import _chat_template

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    artifact = SimpleNamespace(tokenizer_path=tmp_path / "tokenizer.json", model_path=tmp_path)
    render = _chat_template(artifact, SimpleNamespace(special_tokens=["<|endoftext|>"]))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(messages) == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert _chat_template(artifact, SimpleNamespace(special_tokens=[])) is None

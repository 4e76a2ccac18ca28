"""Log-probabilities on completions and chat (`logprobs`, `top_logprobs`), served as users start
the server and read with the official `openai` client:

- each reported log-probability equals `torch.log_softmax` of the eager model's logits at its
  position within 1e-5 (fp32 plan), and the top alternatives are the model's most likely tokens;
- chat reports the same numbers in its own shape, a stream the same as the whole answer;
- with a stop string, only the kept tokens are reported; speculative decoding reports what plain
  decoding does;
- a bad `top_logprobs` is a 400 in OpenAI's body.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from aviatorc import zoo
from aviatorc.runtime import Session
from aviatorc.runtime.text import load_tokenizer
from aviatorc.serve.engine import Engine, GenerationRequest
from aviatorc.serve.speculative import DraftModel, Speculator
from tests.serve.servers import start_server
from tests.serve.test_engine import serve

openai = pytest.importorskip("openai")
TOLERANCE = 1e-5  # fp32 plan against eager fp32 PyTorch


@pytest.fixture(scope="module")
def server(artifacts, tokenizer_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with start_server(str(artifacts["llama"]), "--tokenizer", str(tokenizer_dir), log=log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """log_softmax of the eager model's logits after each prefix of `ids`: [len(ids), vocab]."""
    model = zoo.build_model("llama").inner.eval()  # the model the served artifact was compiled from

    def log_probs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    return log_probs


def test_completion_logprobs_are_the_models_log_softmax(client, reference, tokenizer_dir):
    prompt = [7, 8, 9, 10, 11]
    out = client.completions.create(model="llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    want = reference(prompt + ids)[len(prompt) - 1:-1]  # the distribution each generated token was drawn from
    got = choice.logprobs
    assert len(got.token_logprobs) == len(ids) == 6
    assert np.abs(np.array(got.token_logprobs) - want[np.arange(6), ids]).max() < TOLERANCE
    for row, top, token in zip(want, got.top_logprobs, ids):
        best = np.argsort(-row, kind="stable")[:3]
        assert len(top) == 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert np.abs(np.array(list(top.values())) - row[best]).max() < TOLERANCE
        assert max(top.values()) == pytest.approx(row[token], abs=TOLERANCE)  # greedy: the chosen one is the best
    assert got.text_offset == list(np.cumsum([0] + [len(t) for t in got.tokens[:-1]]))
    assert got.tokens == [load_tokenizer(tokenizer_dir).decode([i]) for i in ids]


def test_chat_logprobs_in_chats_shape_and_a_stream_reports_the_same(client, tokenizer_dir, reference):
    tok = load_tokenizer(tokenizer_dir)
    messages = [{"role": "user", "content": "w11 w12 w13"}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = whole.choices[0].model_extra["token_ids"]
    content = whole.choices[0].logprobs.content
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    want = reference(prompt + ids)[len(prompt) - 1:-1]
    assert [c.token for c in content] == [tok.decode([i]) for i in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert np.abs(np.array([c.logprob for c in content]) - want[np.arange(len(ids)), ids]).max() < TOLERANCE
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    stream = client.chat.completions.create(model="llama", messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in content]
    plain = client.chat.completions.create(model="llama", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None  # only when asked


def test_a_stop_string_reports_only_the_kept_tokens(client, session_text):
    text, stop = session_text
    out = client.completions.create(model="llama", prompt=text, max_tokens=12, temperature=0, logprobs=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"]) == out.usage.completion_tokens
    assert all(top == {} for top in choice.logprobs.top_logprobs)  # logprobs=0: the chosen tokens only


@pytest.fixture(scope="module")
def session_text(artifacts, tokenizer_dir) -> tuple[str, str]:
    """A prompt and a stop string that its greedy continuation reaches at its fourth token."""
    tok = load_tokenizer(tokenizer_dir)
    text = "w20 w21 w22 w23"
    ids = Session(artifacts["llama"]).generate(tok.encode(text), 12, eos_token_id=())[len(tok.encode(text)):].tolist()
    return text, tok.decode([ids[3]])


def test_a_bad_top_logprobs_is_a_400(server):
    url = server.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "w11"}]
    for body, message in [({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"logprobs": "yes"}, "logprobs")]:
        response = httpx.post(url, json={"model": "llama", "messages": messages, "max_tokens": 2, **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    response = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": [5], "logprobs": True})
    assert response.status_code == 400 and "logprobs" in response.json()["error"]["message"]


def test_speculative_decoding_reports_what_plain_decoding_does(artifacts):
    target = Session(artifacts["llama"])
    prompts = [[9, 10, 11], [30, 31, 32, 33]]

    def run(speculator: Speculator | None) -> list[GenerationRequest]:
        reqs = [GenerationRequest(prompt=p, max_tokens=8, logprobs=2) for p in prompts]
        asyncio.run(serve(Engine(target, speculator=speculator), reqs))
        return reqs

    plain = run(None)
    speculating = Speculator(target, DraftModel(Session(artifacts["llama"]), target), 3)  # its own draft: all accepted
    drafted = run(speculating)
    assert speculating.accepted > 0
    for a, b in zip(plain, drafted):
        assert a.generated == b.generated and len(a.reported) == len(a.generated)
        assert [r.token for r in a.reported] == a.generated == [r.token for r in b.reported]
        assert np.abs(np.array([r.logprob for r in a.reported]) - [r.logprob for r in b.reported]).max() < TOLERANCE
        assert [[t for t, _ in r.top] for r in a.reported] == [[t for t, _ in r.top] for r in b.reported]

"""`aviatorc serve` as users start it: a subprocess on 127.0.0.1 (ephemeral port), driven with the
official `openai` client and with raw `httpx`:

- greedy completions (token ids and text) and chat completions equal `Session.generate`;
- the SSE stream: `data:` events, `finish_reason` only on the last chunk, the usage chunk,
  `data: [DONE]`; streamed text and ids equal the non-streamed ones;
- `usage` counts, `/v1/models`, `/metrics` counting requests by outcome;
- errors in OpenAI's body: unknown model 404, unsupported field 400, full queue 429, timeout 504;
- a client that disconnects mid-stream frees its slot.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from aviatorc.runtime import Session
from aviatorc.runtime.text import load_tokenizer
from tests.serve.servers import CONTEXT, EOS, SLOTS, start_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(artifacts, tokenizer_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with start_server(str(artifacts["llama"]), "--tokenizer", str(tokenizer_dir), "--max-queue", "4",
                      log=log) as running:
        yield running


@pytest.fixture(scope="module")
def session(artifacts) -> Session:
    return Session(artifacts["llama"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(session: Session, prompt: list[int], new: int, eos: int | None = EOS) -> list[int]:
    return session.generate(prompt, new, eos_token_id=eos)[len(prompt):].tolist()


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted({"model": "llama", **labels}.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            body = line[len(name) + 1:line.index("}")]
            if ",".join(sorted(body.split(","))) == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_greedy_completion_from_token_ids_equals_session_generate(client, session):
    prompt = [7, 8, 9, 10, 11]
    out = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    want = greedy(session, prompt, 12)
    assert choice.model_extra["token_ids"] == want
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == len(want)
    assert out.usage.total_tokens == 5 + len(want)


def test_a_text_prompt_goes_through_the_tokenizer_both_ways(client, session, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    text = "w20 w21 w22 w23"
    out = client.completions.create(model="llama", prompt=text, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    want = greedy(session, tok.encode(text), 10, eos=None)
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(tok.encode(text)) and out.usage.completion_tokens == 10
    assert "token_ids" not in (out.choices[0].model_extra or {})  # only when asked, for a model with a tokenizer


def test_several_prompts_in_one_request_are_separate_choices(client, session):
    prompts = [[30, 31, 32], [40, 41], [50, 51, 52, 53]]
    out = client.completions.create(model="llama", prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, prompt in zip(out.choices, prompts):
        assert choice.model_extra["token_ids"] == greedy(session, prompt, 6, eos=None)
    assert out.usage.prompt_tokens == 9 and out.usage.completion_tokens == 18


def test_chat_uses_the_tokenizers_chat_template(client, session, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11 w12 w13"}]
    out = client.chat.completions.create(model="llama", messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    want = greedy(session, ids, 8)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.model_extra["token_ids"] == want
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)


def test_the_stream_is_sse_with_done_and_usage(server, session):
    body = {"model": "llama", "prompt": [12, 13, 14], "max_tokens": 7, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and reasons[-1] == "length"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == greedy(session, [12, 13, 14], 7, eos=None)
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)


def test_streamed_chat_equals_the_whole_answer(client):
    messages = [{"role": "user", "content": "w30 w31 w32"}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=9, temperature=0)
    stream = client.chat.completions.create(model="llama", messages=messages, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_seeded_sampling_repeats_and_differs_from_greedy(client):
    def run(seed: int | None, temperature: float) -> list[int]:
        out = client.completions.create(model="llama", prompt=[60, 61], max_tokens=16, temperature=temperature,
                                        top_p=0.9, seed=seed, extra_body={"return_token_ids": True, "ignore_eos": True})
        return out.choices[0].model_extra["token_ids"]

    assert run(5, 1.5) == run(5, 1.5)
    assert run(5, 1.5) != run(None, 0.0)


def test_models_lists_the_artifact(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["llama"]
    assert models.data[0].model_extra["max_model_len"] == CONTEXT


def test_errors_use_the_openai_body(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model="llama", prompt=[1, 2], max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="llama", prompt=[1, 100000], max_tokens=2)
    response = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": [1], "max_tokens": 0})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    # ignore_eos: a sampled end-of-text as the first token would end the request before its deadline
    response = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": [5, 6], "max_tokens": 50,
                                                                 "ignore_eos": True, "timeout": 0.001})
    assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]


def test_a_stop_string_ends_the_text_and_the_counted_tokens_there(client, session, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    prompt = "w40 w41 w42"
    free = greedy(session, tok.encode(prompt), 8, eos=None)
    stop_at = next(i for i in range(1, 8) if free[i] not in free[:i])  # a word that first appears at i
    stop = tok.decode([free[stop_at]])
    out = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == free[:stop_at + 1]  # nothing the engine made after the stop
    assert out.usage.completion_tokens == stop_at + 1
    assert choice.text == tok.decode(free[:stop_at], skip_special_tokens=True) + " "


def test_a_bad_prompt_among_several_refuses_them_all(server):
    """A prompt longer than the context is refused as the body is read, before any is queued; five
    prompts for a queue of four are queued until the fifth does not fit, then all withdrawn."""
    before = metric(server, "aviatorc_requests_total", outcome="cancelled")
    body = {"model": "llama", "prompt": [[5, 6], [7] * CONTEXT], "max_tokens": 50, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [[5, 6 + i] for i in range(5)]},
                          timeout=60)
    assert response.status_code == 429 and "queue is full" in response.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while metric(server, "aviatorc_num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "aviatorc_num_requests_running") == 0
    assert metric(server, "aviatorc_requests_total", outcome="cancelled") - before == 4  # the first four, withdrawn


def test_bad_json_an_oversized_prompt_and_a_negative_max_tokens_get_a_4xx_with_a_message(server):
    cases = {
        "bad json": httpx.post(server.url + "/v1/completions", content=b'{"prompt": [1, 2', timeout=30,
                               headers={"content-type": "application/json"}),
        "oversized": httpx.post(server.url + "/v1/completions", json={"prompt": [5] * (CONTEXT + 10)}, timeout=30),
        "negative": httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": -3}, timeout=30),
        "unknown model": httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": [5]}, timeout=30),
    }
    for case, response in cases.items():
        assert 400 <= response.status_code < 500, case
        assert response.json()["error"]["message"], case
    assert "context" in cases["oversized"].json()["error"]["message"]
    assert "max_tokens" in cases["negative"].json()["error"]["message"]


def test_a_negative_seed_is_a_bad_request(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": [5], "seed": -1})
    assert response.status_code == 400 and "seed" in response.json()["error"]["message"]


def test_a_full_queue_answers_429_and_a_disconnect_frees_the_slot(server):
    """Long streams opened one after another until one is refused: with --max-queue 4 that is once 4
    wait behind the running ones (a stream of 500 tokens takes a second or more here; opening one
    takes milliseconds; how many run by then depends on how fast the engine admits them, so the
    test counts what it gets). The refusal is a 429 that says so. Then the clients go away
    mid-stream: every slot is freed and each request counted as cancelled."""
    body = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": CONTEXT - 8, "temperature": 0, "stream": True,
            "ignore_eos": True}
    cancelled_before = metric(server, "aviatorc_requests_total", outcome="cancelled")
    clients = [httpx.Client(base_url=server.url, timeout=60) for _ in range(SLOTS + 5)]
    streams = []
    refused = None
    try:
        for c in clients:  # each returns once the server has queued its request (the SSE headers came) or refused it
            ctx = c.stream("POST", "/v1/completions", json=body)
            streams.append((ctx, ctx.__enter__()))
            if streams[-1][1].status_code != 200:
                refused = streams[-1][1]
                refused.read()
                break
        assert refused is not None and refused.status_code == 429, "no request was refused"
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "queue is full (4 requests waiting)" in error["message"]
        accepted = [response for _, response in streams if response.status_code == 200]
        assert len(accepted) >= 5  # the 4 waiting and at least one running
        first = next(line for line in accepted[0].iter_lines() if line)  # the running ones do stream
        assert first.startswith("data: {")
    finally:
        for ctx, _ in streams:
            ctx.__exit__(None, None, None)
        for c in clients:
            c.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (metric(server, "aviatorc_num_requests_running") > 0
                                            or metric(server, "aviatorc_num_requests_waiting") > 0):
        time.sleep(0.05)
    assert metric(server, "aviatorc_num_requests_running") == 0 and metric(server, "aviatorc_num_requests_waiting") == 0
    assert metric(server, "aviatorc_requests_total", outcome="cancelled") - cancelled_before == len(accepted)
    assert metric(server, "aviatorc_requests_total", outcome="rejected") >= 1
    # The freed slots serve the next requests.
    out = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_metrics_also_carry_vllms_names(server, client):
    """Every aliased family (`VLLM_ALIASES`) appears under vLLM's name with the label `model_name`
    and the same values in the same scrape; finished requests by their finished_reason."""
    from prometheus_client.parser import text_string_to_metric_families

    from aviatorc.serve.metrics import VLLM_ALIASES

    client.completions.create(model="llama", prompt=[70, 71], max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    for ours, theirs in VLLM_ALIASES.items():
        expected = {}
        for sample in families[ours].samples:
            labels = {("model_name" if k == "model" else "finished_reason" if k == "outcome" else k): v
                      for k, v in sample.labels.items()}
            if labels.get("finished_reason", "stop") in ("stop", "length"):
                expected[(theirs + sample.name[len(ours):], tuple(sorted(labels.items())))] = sample.value
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in families[theirs].samples}
        assert got == expected, theirs
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success["length"] >= 1 and set(success) <= {"stop", "length"}
    assert families["vllm:generation_tokens"].samples and families["vllm:kv_cache_usage_perc"].samples
    assert all(s.labels["model_name"] == "llama" for s in families["vllm:num_requests_running"].samples)


def test_metrics_count_tokens_and_outcomes(server, client):
    before = metric(server, "aviatorc_generation_tokens_total")
    length_before = metric(server, "aviatorc_requests_total", outcome="length")
    client.completions.create(model="llama", prompt=[70, 71], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert metric(server, "aviatorc_generation_tokens_total") - before == 5
    assert metric(server, "aviatorc_requests_total", outcome="length") - length_before == 1
    assert metric(server, "aviatorc_time_to_first_token_seconds_count") >= 1
    text = httpx.get(server.url + "/metrics").text
    for family in ("aviatorc_time_per_output_token_seconds", "aviatorc_batch_occupancy",
                   "aviatorc_generation_tokens_per_second", "aviatorc_decode_batch_size"):
        assert family in text
    # Idle again (another test's stream may still be ending): every block back in the pool (the
    # plan's 4 slots x 512 tokens, 16 a block).
    deadline = time.monotonic() + 30
    while metric(server, "aviatorc_kv_blocks", state="free") != 128 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "aviatorc_kv_blocks", state="free") == 128
    assert metric(server, "aviatorc_kv_blocks", state="used") == metric(server, "aviatorc_kv_cache_usage_perc") == 0


def test_a_model_that_cannot_serve_is_refused_before_listening(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "aviatorc", "serve", str(tmp_path / "missing.avc"), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not an artifact directory" in out.stderr and "listening" not in out.stdout


def test_a_preempted_stream_is_swapped_out_and_back_and_ends_as_it_would_alone(artifacts, tokenizer_dir, tmp_path,
                                                                                session):
    """One sequence at a time under `priority`: an interactive request (priority 0) preempts a
    background stream (priority 10) once that has streamed a few tokens. The background's KV
    cache goes to host memory (--swap-space) and comes back, and it still streams the greedy
    tokens it gets alone; the swap space is empty again after."""
    import threading

    with start_server(str(artifacts["llama"]), "--tokenizer", str(tokenizer_dir), "--scheduling-policy", "priority",
                      "--max-num-seqs", "1", "--swap-space", "0.01", log=tmp_path / "server.log") as server:
        body = {"model": "llama", "prompt": [40, 41, 42], "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True, "priority": 10}
        urgent = {"model": "llama", "prompt": [50, 51], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True, "priority": 0}
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(
            httpx.post(server.url + "/v1/completions", json=urgent, timeout=60)))
        tokens: list[int] = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if len(tokens) >= 3 and sender.ident is None:  # not started yet
                        sender.start()
        sender.join(timeout=60)
        assert answers[0].status_code == 200
        assert answers[0].json()["choices"][0]["token_ids"] == greedy(session, [50, 51], 4, eos=None)
        assert tokens == greedy(session, [40, 41, 42], 400, eos=None)
        assert metric(server, "aviatorc_num_preemptions_total", swapped="true") == 1
        assert metric(server, "aviatorc_num_preemptions_total", swapped="false") == 0
        assert metric(server, "aviatorc_swap_space_bytes") == 0

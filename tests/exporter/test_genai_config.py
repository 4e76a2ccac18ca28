"""A decoder with its KV cache, exported: `genai_config.json` beside it, and greedy tokens equal to
`aviatorc.Session(...).generate`, token for token, in plain onnxruntime (a step loop feeding each
step's present cache back as the next step's past) and in onnxruntime-genai, where its CPU wheel
is installed (`pip install onnxruntime-genai`; the test is skipped without it).

The decoder is the zoo's tiny Llama decode-step export (dynamic past and new lengths, flat cache
names `past_key_0` / `present_key_0`), compiled at INT4 g32 for the mock target. Greedy decoding
compares argmaxes, so float32 differences of ~1e-7 (test_onnx_parity.py) cannot change a token
unless two logits tie to within that; the tokens are equal, not close.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.exporter import export
from aviatorc.runtime.cache import find_cache
from tests.zoo_fixtures import decode_onnx_path, zoo_dir  # noqa: F401

NEW_TOKENS = 16
CONTEXT = 48
EOS = 2  # the zoo configs' eos_token_id


@pytest.fixture(scope="module")
def decoder(zoo_dir, tmp_path_factory):  # noqa: F811
    """(exported model path, artifact path) of the tiny Llama with its KV cache."""
    tmp = tmp_path_factory.mktemp("decoder")
    art = tmp / "llama.avc"
    aviatorc.compile(str(decode_onnx_path("llama", zoo_dir)), target="mock", quant="int4", group_size=32,
                     context=CONTEXT, prompt=8, batch=1, time_limit_s=1.0).save(art, html_report=False)
    out = export(art, tmp / "onnx" / "model.onnx", eos_token_id=EOS)
    return out, art


def prompt() -> np.ndarray:
    return zoo.example_inputs("llama")["input_ids"][0].numpy()


def ort_greedy(path: Path, graph, ids: np.ndarray, new: int) -> np.ndarray:
    """Greedy decoding with plain onnxruntime: prefill, then one token per step, the cache fed back."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    layout = find_cache(graph)
    assert layout is not None
    names = [o.name for o in session.get_outputs()]
    past = {p.past: np.zeros((1, int(layout.past_shapes[p.past][1]), 0, int(layout.past_shapes[p.past][3])),
                             np.float32) for p in layout.pairs}
    tokens, step_ids = list(ids), ids[None, :]
    for _ in range(new):
        total = len(tokens)
        feeds = {"input_ids": step_ids, "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(total - step_ids.shape[1], total, dtype=np.int64)[None, :], **past}
        out = dict(zip(names, session.run(None, feeds), strict=True))
        token = int(out[layout.logits][0, -1].argmax())
        tokens.append(token)
        if token == EOS:
            break
        past = {p.past: out[p.present] for p in layout.pairs}
        step_ids = np.array([[token]], np.int64)
    return np.array(tokens, np.int64)


def test_genai_config_describes_the_decoder(decoder):
    out, _ = decoder
    assert out.genai_config == out.path.parent / "genai_config.json"
    config = json.loads(out.genai_config.read_text())
    model = config["model"]
    assert model["decoder"]["filename"] == "model.onnx"
    assert model["decoder"]["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                          "position_ids": "position_ids", "past_key_names": "past_key_%d",
                                          "past_value_names": "past_value_%d"}
    assert model["decoder"]["outputs"] == {"logits": "logits", "present_key_names": "present_key_%d",
                                           "present_value_names": "present_value_%d"}
    tiny = zoo.config("llama")
    assert (model["decoder"]["num_hidden_layers"], model["decoder"]["num_key_value_heads"],
            model["decoder"]["num_attention_heads"], model["decoder"]["head_size"],
            model["decoder"]["hidden_size"]) == (tiny.num_hidden_layers, tiny.num_key_value_heads,
                                                 tiny.num_attention_heads, tiny.head_dim, tiny.hidden_size)
    assert (model["vocab_size"], model["context_length"], model["eos_token_id"]) == (tiny.vocab_size, CONTEXT, EOS)
    assert config["search"]["max_length"] == CONTEXT and config["search"]["do_sample"] is False


@pytest.mark.slow
def test_onnxruntime_greedy_tokens_equal_the_sim_runtime(decoder):
    out, art = decoder
    ids = prompt()
    want = aviatorc.Session(art, device="sim").generate(ids, NEW_TOKENS, eos_token_id=EOS)
    got = ort_greedy(out.path, aviatorc.load(art).graph(), ids, NEW_TOKENS)
    assert len(want) > len(ids)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_onnxruntime_genai_greedy_tokens_equal_the_sim_runtime(decoder):
    og = pytest.importorskip("onnxruntime_genai")
    out, art = decoder
    ids = prompt()
    want = aviatorc.Session(art, device="sim").generate(ids, NEW_TOKENS, eos_token_id=EOS)
    model = og.Model(str(out.path.parent))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids.astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    got = np.asarray(generator.get_sequence(0), np.int64)
    np.testing.assert_array_equal(got, want)

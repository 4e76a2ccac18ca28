"""Generation on the sim runtime: decoder graphs that carry their KV cache, compiled from an ONNX
decode export (`aviatorc.zoo.export_decode_onnx`: one graph, dynamic past and new lengths) and
from the torch module itself (the compiler builds the step graph: `frontends.torch.decoder`).

- greedy generation of 32 tokens equals `transformers`' `generate` token for token (tiny GPT-2,
  Llama, Qwen2; both cache naming conventions);
- the step API (`prefill` / `decode` / `free`) interleaving two sequences gives what each gives
  alone, within the plan's KV slots and context;
- sampling is seeded and keeps to its nucleus; graphs that cannot generate say why.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.errors import OptionError
from aviatorc.runtime import NotRunnableError, RuntimeInputError, Session
from aviatorc.runtime.cache import find_cache
from aviatorc.runtime.sampling import sample
from tests.zoo_fixtures import decode_onnx_path, zoo_dir, zoo_onnx  # noqa: F401

NEW_TOKENS = 32
CONTEXT = 48  # prompt 8 + 32 new fit; the zoo's models know 64 positions


@pytest.fixture(scope="module")
def sessions(zoo_dir):  # noqa: F811
    cache: dict[tuple[str, str], Session] = {}

    def get(arch: str, source: str = "flat") -> Session:
        """`source`: "torch" (the zoo's module), or the cache naming of an ONNX decode export."""
        if (arch, source) not in cache:
            model = zoo.build_model(arch).inner.eval() if source == "torch" else str(
                decode_onnx_path(arch, zoo_dir, source))
            cache[arch, source] = Session(aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8,
                                                           batch=2, time_limit_s=1.0))
        return cache[arch, source]

    return get


def prompt(arch: str, seed: int = 0) -> np.ndarray:
    return zoo.example_inputs(arch, seed=seed)["input_ids"][0].numpy()


def transformers_greedy(arch: str, ids: np.ndarray, new: int) -> np.ndarray:
    model = zoo.build_model(arch).inner.eval()
    batch = torch.from_numpy(ids)[None, :]
    with torch.no_grad():
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].numpy()


@pytest.mark.parametrize("arch, source", [("gpt2", "flat"), ("llama", "flat"), ("qwen2", "hf"),
                                          ("gpt2", "torch"), ("llama", "torch"), ("qwen2", "torch")])
def test_greedy_generation_equals_transformers_token_for_token(arch, source, sessions):
    session = sessions(arch, source)
    ids = prompt(arch)
    ours = session.generate(ids, NEW_TOKENS)
    want = transformers_greedy(arch, ids, NEW_TOKENS)
    assert len(ours) == len(ids) + NEW_TOKENS
    np.testing.assert_array_equal(ours, want)
    assert session.stats is not None and session.stats.phase == "decode"
    assert session.stats.extra["generated_tokens"] == NEW_TOKENS


def test_the_cache_is_recognized_under_both_namings(sessions):
    for source, past, present in [("flat", "past_key_0", "present_key_0"),
                                  ("hf", "past_key_values.0.key", "present.0.key"),
                                  ("torch", "past_key_values.0.key", "present.0.key")]:
        layout = sessions("qwen2", source).cache
        assert layout is not None and layout.attention_mask == "attention_mask"
        pair = layout.pairs[0]
        assert (pair.past, pair.present, pair.axis, pair.kind) == (past, present, 2, "key")
        assert len(layout.pairs) == 2 * zoo.config("qwen2").num_hidden_layers


def test_interleaved_slots_give_what_each_sequence_gives_alone(sessions):
    session = sessions("llama")
    assert session.num_slots == 2 and session.context == CONTEXT
    a, b = prompt("llama", seed=1), prompt("llama", seed=2)[:5]
    alone = [session.generate(x, 6)[len(x):].tolist() for x in (a, b)]
    logits = [session.prefill(0, a), session.prefill(1, b)]
    got: list[list[int]] = [[], []]
    for _ in range(6):
        tokens = [int(np.argmax(row)) for row in logits]
        for i, t in enumerate(tokens):
            got[i].append(t)
        logits = list(session.decode([0, 1], tokens))
    assert got == alone and got[0] != got[1]
    assert session.slot_length(0) == len(a) + 6 and session.slot_length(1) == len(b) + 6
    session.free(0)
    assert session.slot_length(0) == 0
    with pytest.raises(OptionError, match="holds no sequence"):
        session.decode([0], [1])
    with pytest.raises(OptionError, match="in use"):
        session.prefill(1, b)
    with pytest.raises(OptionError, match="holds 2 sequences"):
        session.prefill(2, b)
    session.free(1)


def test_generation_stops_at_eos_and_at_the_plans_context(sessions):
    session = sessions("llama")
    ids = prompt("llama")
    greedy = session.generate(ids, 10)
    eos = int(greedy[len(ids) + 3])
    stopped = session.generate(ids, 10, eos_token_id=eos)
    first = len(ids) + greedy[len(ids):].tolist().index(eos)
    np.testing.assert_array_equal(stopped, greedy[:first + 1])
    with pytest.raises(RuntimeInputError, match=f"context of {CONTEXT}"):
        session.generate(ids, CONTEXT)


def test_sampling_is_seeded_and_keeps_to_its_nucleus(sessions):
    session = sessions("gpt2")
    ids = prompt("gpt2")
    one = session.generate(ids, 8, temperature=1.0, seed=7)
    assert np.array_equal(one, session.generate(ids, 8, temperature=1.0, seed=7))
    assert not np.array_equal(one, session.generate(ids, 8, temperature=1.0, seed=8))
    np.testing.assert_array_equal(session.generate(ids, 8, temperature=1.0, top_p=1e-6, seed=3),
                                  session.generate(ids, 8))  # a nucleus of one token is greedy

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = np.bincount([sample(logits, temperature=1.0, top_p=0.75, rng=rng) for _ in range(4000)], minlength=4)
    assert draws[2] == draws[3] == 0  # 0.5 + 0.3 is the smallest set reaching top_p: the tail is never drawn
    assert draws[0] / draws[:2].sum() == pytest.approx(0.5 / 0.8, abs=0.03)
    with pytest.raises(OptionError, match="top_p"):
        sample(logits, temperature=1.0, top_p=0)


def test_a_static_shape_export_says_why_it_cannot_generate(zoo_onnx):  # noqa: F811
    art = aviatorc.compile(str(zoo_onnx("llama", "legacy")), target="mock", context=64, prompt=8, time_limit_s=1.0)
    session = Session(art)
    assert find_cache(session.graph) is None
    with pytest.raises(NotRunnableError, match="static sequence length \\(8\\)"):
        session.generate(prompt("llama"), 4)


# -- the command line ----------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aviatorc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def llama_artifact(sessions, tmp_path_factory):
    return sessions("llama").artifact.path


def word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer over the zoo's 128 ids ("w0" .. "w127"), saved as a HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(zoo.VOCAB_SIZE)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(str(folder))
    return folder


def test_cli_generate_prints_the_sessions_tokens_as_ids_and_as_text(sessions, llama_artifact, tmp_path):
    ids = prompt("llama")
    want = sessions("llama").generate(ids, 12)[len(ids):].tolist()
    done = cli("generate", str(llama_artifact), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ",".join(map(str, want))
    folder = word_tokenizer(tmp_path / "tok")
    text = " ".join(f"w{i}" for i in ids)
    done = cli("generate", str(llama_artifact), "--prompt", text, "--tokenizer", str(folder), "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"w{i}" for i in want]
    done = cli("generate", str(llama_artifact), "--prompt", text, "--max-new-tokens", "2")
    assert done.returncode == 1 and "needs a tokenizer" in done.stderr and "Traceback" not in done.stderr


def test_cli_run_writes_the_sessions_outputs_and_nothing_on_bad_input(sessions, llama_artifact, tmp_path):
    feeds = {k: v.numpy() for k, v in zoo.decode_example_inputs("llama", past=3, new=2).items()}
    np.savez(tmp_path / "feeds.npz", **feeds)
    out = tmp_path / "out.npz"
    done = cli("run", str(llama_artifact), "--inputs", str(tmp_path / "feeds.npz"), "--output", str(out))
    assert done.returncode == 0, done.stderr
    want = sessions("llama").run(feeds)
    with np.load(out) as got:
        assert sorted(got.files) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    np.savez(tmp_path / "bad.npz", **{**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    bad_out = tmp_path / "bad-out.npz"
    done = cli("run", str(llama_artifact), "--inputs", str(tmp_path / "bad.npz"), "--output", str(bad_out))
    assert done.returncode == 1 and "input_ids" in done.stderr and "Traceback" not in done.stderr
    assert not bad_out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_last_steps_timeline_is_written_as_a_chrome_trace(sessions, tmp_path):
    import json

    session = sessions("llama")
    session.generate(prompt("llama"), 2)
    trace = session.trace(tmp_path / "decode.json")
    assert json.loads((tmp_path / "decode.json").read_text()) == trace
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["traceEvents"][0]["args"]["name"] == "decode step"
    end = max(e["ts"] + e["dur"] for e in spans) * 1e-6
    assert end == pytest.approx(session.stats.predicted_decode_s, rel=1e-6)
    ops = session.artifact.programs["decode"].count()
    assert "compute" in {e["cat"] for e in spans}
    assert ("send" in {e["cat"] for e in spans}) == ("send" in ops)  # a send in the plan is a span on the link

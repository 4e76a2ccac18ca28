"""Hostile Hugging Face config.json files (issue 13, classes 3, 4, 5 and 6): each is refused
with one AviatorError naming the field, before `transformers` builds anything, and quickly.
Without the validation these ended in tracebacks from inside `transformers`, in the
partitioner (compile only), in hangs, or in a silently accepted model."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aviatorc.errors import AviatorError, ModelFormatError, UnsupportedModelError
from aviatorc.frontends import hf_config
from aviatorc.frontends.torch import import_hf_config

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_positions": 64, "vocab_size": 128}


@contextlib.contextmanager
def within(seconds: int):
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`."""

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(tmp_path, content, error=ModelFormatError, seconds: int = 60) -> AviatorError:
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    start = time.perf_counter()
    with within(seconds), pytest.raises(error) as info:
        import_hf_config(path)
    assert time.perf_counter() - start < seconds
    assert "\n" not in str(info.value) and info.value.file == str(path)
    return info.value


def with_(base, **fields):
    return {**base, **fields}


# -- class 3: fields transformers chokes on ------------------------------------------------


@pytest.mark.parametrize("fields, field, message", [
    ({"hidden_size": "64"}, "hidden_size", "hidden_size is '64'; it must be an integer in [1, 65,536]"),
    ({"vocab_size": 12.5}, "vocab_size", "vocab_size is 12.5; it must be an integer"),
    ({"hidden_size": 0}, "hidden_size", "hidden_size is 0"),
    ({"intermediate_size": -5}, "intermediate_size", "intermediate_size is -5"),
    ({"num_attention_heads": 0}, "num_attention_heads", "num_attention_heads is 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "num_key_value_heads is 0"),
    ({"num_attention_heads": 5}, "num_attention_heads", "hidden_size 64 is not divisible by num_attention_heads 5"),
    ({"num_key_value_heads": 3}, "num_key_value_heads",
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"rope_theta": "ten thousand"}, "rope_theta", "rope_theta is 'ten thousand'; it must be a number"),
    ({"rope_scaling": {"rope_type": "warp", "factor": 2.0}}, "rope_scaling",
     "rope_scaling type 'warp' is not one transformers knows"),
    ({"model_type": ["llama"]}, "model_type", "model_type is [\"llama\"]; it must be a string"),
    ({"__class__": "x"}, "__class__", "config field '__class__' is not a valid field name"),
    ({"to_dict": 1}, "to_dict", "config field 'to_dict' names a method or property of LlamaConfig"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings", "tie_word_embeddings is 'no'; it must be true or false"),
    ({"hidden_act": "64"}, "hidden_act", "hidden_act '64' is not an activation transformers knows"),  # tools/fuzz.py
])
def test_shape_fields_of_the_wrong_type_range_or_divisibility(tmp_path, fields, field, message) -> None:
    error = refused(tmp_path, with_(LLAMA, **fields))
    assert message in str(error) and error.fields["field"] == field


@pytest.mark.parametrize("architecture", ["AutoTokenizer", "pipeline", "BertModel", "LlamaForSequenceClassification"])
def test_architectures_come_from_an_allow_list(tmp_path, architecture) -> None:
    error = refused(tmp_path, with_(LLAMA, architectures=[architecture]), UnsupportedModelError)
    assert f"architecture '{architecture}' is not supported for model_type 'llama'" in str(error)
    assert error.hint == "aviatorc builds causal-LM and base model classes: LlamaForCausalLM, LlamaModel"


def test_unknown_model_type_is_not_supported(tmp_path) -> None:
    error = refused(tmp_path, with_(LLAMA, model_type="lama"), UnsupportedModelError)
    assert "transformers does not know model_type 'lama'" in str(error) and error.hint == "did you mean 'llama'?"


@pytest.mark.parametrize("content, message", [
    (b"[" * 100_000 + b"]" * 100_000, "the config nests 100000 levels deep (at most 32)"),
    (b'{"model_type": "llama", "vocab_size": ' + b"9" * 5001 + b"}", "an integer of 5001 digits"),
    (b'{"model_type": "ll\xffama"}', "the config is not UTF-8 (byte 18"),
    (b'{"model_type": "llama", "rope_theta": NaN}', "the config holds NaN"),
    (b'{"model_type": "llama", "rope_theta": 1e999}', "which overflows a float"),
    (b'{"model_type": "llama", "model_type": "bert"}', "gives key 'model_type' twice"),
    (b'["model_type"]', "the config is a JSON array, not an object"),
    (b" " * (2 << 20), "larger than 1 MiB"),
])
def test_the_json_read_is_bounded_and_strict(tmp_path, content, message) -> None:
    assert message in str(refused(tmp_path, content))


# -- class 4: compile-only failures, refused at import ---------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"vocab_size": 0}, "vocab_size is 0"),
    ({"intermediate_size": 0}, "intermediate_size is 0"),
])
def test_sizes_the_partitioner_cannot_tile_are_refused_at_import(tmp_path, fields, message) -> None:
    assert message in str(refused(tmp_path, with_(LLAMA, **fields)))


# -- class 5: depths a shape-only import cannot finish ----------------------------------------


@pytest.mark.parametrize("layers", [10**4, 10**9])
def test_deep_models_are_refused_up_front_with_the_figure(tmp_path, layers) -> None:
    error = refused(tmp_path, with_(LLAMA, num_hidden_layers=layers), seconds=30)
    assert f"num_hidden_layers is {layers:,}: a shape-only import traces every layer" in str(error)
    assert "aviatorc imports at most 256 layers" in str(error)


def test_deep_gpt2_is_refused_under_its_own_field_name(tmp_path) -> None:
    error = refused(tmp_path, with_(GPT2, n_layer=5000), seconds=30)
    assert "is 5,000: a shape-only import traces every layer" in str(error)


# -- class 6: accepted, but wrong --------------------------------------------------------------


def test_negative_layer_count(tmp_path) -> None:
    error = refused(tmp_path, with_(LLAMA, num_hidden_layers=-1))
    assert "num_hidden_layers is -1; it must be an integer in [1, 1,000,000,000]" in str(error)


def test_a_valid_config_still_imports(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_(GPT2, architectures=None)))
    graph = import_hf_config(path)
    assert graph.metadata["architecture"] == "GPT2LMHeadModel"


# -- a property: any value in a shape field passes the checks or is refused -------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(hf_config.FIELDS) + ["architectures", "rope_scaling", "rope_parameters"]),
       value=JSON_VALUES)
def test_any_value_of_a_shape_field_is_checked_or_refused(field, value) -> None:
    """check_fields either refuses with an AviatorError or leaves a value that has the
    field's type and range (so transformers gets no string for a size)."""
    config = with_(LLAMA, **{field: value})
    try:
        hf_config.check_fields(config)
    except AviatorError as error:
        assert "\n" not in str(error)
        return
    spec = hf_config.FIELDS.get(field)
    if spec is not None and value is not None:
        expected = {"int": int, "number": (int, float), "bool": bool, "str": str}[spec.kind]
        assert isinstance(value, expected)
        if spec.kind in ("int", "number"):
            assert not isinstance(value, bool) and spec.low <= value <= spec.high


# -- issue 10, item 6: sizes from defaults are warned about; an encoder-decoder is refused ----


def test_sizes_left_to_the_defaults_are_warned_about_with_the_values_used(tmp_path, caplog) -> None:
    # Before: {"model_type": "llama"} alone silently became a 6.7B model; here one field is left out.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "intermediate_size"}))
    with caplog.at_level("WARNING", logger="aviatorc"):
        import_hf_config(path)
    (record,) = [r for r in caplog.records if r.name == "aviatorc.frontends.hf_config"]
    assert record.levelname == "WARNING"
    count = 128 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 11008 + 2 * 64) + 64
    assert record.getMessage() == (
        f"{path}: the config does not set intermediate_size, so transformers' defaults for 'llama' are used "
        f"(intermediate_size 11,008): a {count:,}-parameter model; set them to plan the model you mean")


def test_a_config_that_sets_every_size_gets_no_warning(tmp_path, caplog) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))  # GPT-2's own field names (n_embd, n_layer, n_head): nothing defaulted
    with caplog.at_level("WARNING", logger="aviatorc"):
        import_hf_config(path)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("aviatorc")] == []


def test_defaulted_sizes_names_every_size_of_a_bare_model_type() -> None:
    from transformers import LlamaConfig

    assert hf_config.defaulted_sizes({"model_type": "llama"}, LlamaConfig) == {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
        "vocab_size": 32000}


T5 = {"model_type": "t5", "is_encoder_decoder": True, "d_model": 64, "num_layers": 2, "num_heads": 2, "d_ff": 128,
      "d_kv": 32, "vocab_size": 100}


@pytest.mark.parametrize("config, name", [
    (T5, "T5Model"),  # before: "torch.export failed: ValueError: You must specify exactly one of input_ids..."
    (with_(T5, architectures=["T5ForConditionalGeneration"]), "T5ForConditionalGeneration"),
])
def test_an_encoder_decoder_is_not_supported_by_name(tmp_path, config, name) -> None:
    error = refused(tmp_path, config, UnsupportedModelError)
    assert error.message == (f"{name} (model_type 't5') is an encoder-decoder architecture, which aviatorc does "
                             "not support")
    assert error.fields == {"field": "model_type"}
    assert error.hint == "aviatorc imports decoder-only (causal LM) and encoder-only models"


def test_the_decoder_of_an_encoder_decoder_type_still_imports(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bart", "architectures": ["BartForCausalLM"], "d_model": 64,
                                "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                                "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
                                "vocab_size": 100}))
    assert import_hf_config(path).metadata["architecture"] == "BartForCausalLM"

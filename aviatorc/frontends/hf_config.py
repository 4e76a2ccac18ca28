"""Validation of a Hugging Face `config.json` before `transformers` sees it.

`transformers` trusts its config: a string for a size, a zero head count or a field named
`__class__` ends in a traceback from deep inside it, and `architectures` names any
attribute of the module. So the file passes three gates, in order:

1. `read_config`: a bounded, strict JSON read. At most 1 MiB, UTF-8, nesting at most 32
   deep (json's C scanner recurses), integers of at most 19 digits (Python refuses to
   parse 4,300), no NaN or Infinity, no key given twice, an object at the top.
2. `check_fields`: the types and ranges of the fields that set the model's shape (`FIELDS`),
   and field names that are identifiers and not dunders. Pure Python: a refusal here costs
   no `transformers` import.
3. `check_with_transformers`: the model type is one `transformers` knows; no field shadows
   a method or read-only property of its config class; `architectures[0]` is on the
   allow-list for that model type (its causal-LM class or its base model class, from
   `transformers`' own auto mappings); an encoder-decoder (T5) is refused by name, as nothing
   downstream handles two stacks; a mixture of experts asking for a routing its transformers
   model does not implement (`ROUTING_FIELDS`: DeepSeek's `topk_method`, `scoring_func`) is
   refused by name; the effective sizes (defaults filled in) divide as
   attention needs; and the depth is one a shape-only import finishes quickly.

The parameter count is checked after the model is built on the meta device (`check_built`),
where it is exact and costs nothing. A config that leaves out a size field is built with
transformers' defaults for the model type (`{"model_type": "llama"}` alone is a 6.7B model):
`warn_defaulted_sizes` logs a warning naming the fields, the values used and the count.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aviatorc.errors import ModelFormatError, UnsupportedModelError

_logger = logging.getLogger("aviatorc.frontends.hf_config")

MAX_CONFIG_BYTES = 1 << 20  # released config.json files are a few KiB
MAX_DEPTH = 32  # rope_scaling / quantization_config nest two or three levels
MAX_INT_DIGITS = 19  # int64 range: no shape field is larger
# A shape-only import traces every layer through torch.export: about 0.27 s per layer on
# the project machine (Llama-3-70B, 80 layers: 22 s). The deepest released dense models
# have ~126 layers; 256 keeps headroom and bounds the import near a minute.
MAX_LAYERS = 256
SECONDS_PER_LAYER = 0.27
# Ten times the largest dense models (Llama-3.1-405B); beyond this no target plans it.
MAX_PARAMETERS = 5 * 10**12


@dataclass(frozen=True)
class Field:
    """What one config field may hold: a kind, bounds for numbers, and whether null is allowed."""

    kind: str  # "int", "number", "bool", "str"
    low: float | None = None
    high: float | None = None
    nullable: bool = False
    low_open: bool = False  # low itself is excluded (a positive float)

    def describe(self) -> str:
        kinds = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string"}
        text = kinds[self.kind]
        if self.low is not None and self.high is not None:
            text += f" in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"
        elif self.low is not None:
            text += f" {'>' if self.low_open else '>='} {_num(self.low)}"
        return text + (" or null" if self.nullable else "")


def _num(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else str(value)


def _size(high: int, nullable: bool = False) -> Field:
    return Field("int", 1, high, nullable)


# The fields that set a model's shape, under every name the zoo's families store them by
# (GPT-2: n_embd, n_layer, n_head, n_inner, n_positions; OPT: ffn_dim, word_embed_proj_dim).
# Bounds are an order of magnitude above released models, so only nonsense is refused.
FIELDS: dict[str, Field] = {
    **{name: _size(1 << 16) for name in ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim")},
    **{name: _size(1 << 18, nullable=name == "n_inner") for name in ("intermediate_size", "ffn_dim", "n_inner")},
    **{name: Field("int", 1, 10**9) for name in ("num_hidden_layers", "n_layer", "num_layers")},
    **{name: _size(1 << 12) for name in ("num_attention_heads", "n_head")},
    "num_key_value_heads": _size(1 << 12, nullable=True),
    "head_dim": _size(1 << 12, nullable=True),
    "vocab_size": _size(1 << 22),
    "num_labels": _size(1 << 16),  # transformers builds an id2label dict of this many entries
    "type_vocab_size": _size(1 << 10),
    **{name: _size(1 << 24) for name in ("max_position_embeddings", "n_positions")},
    "sliding_window": _size(1 << 24, nullable=True),
    "rope_theta": Field("number", 0, 1e12, low_open=True),
    "partial_rotary_factor": Field("number", 0, 1, low_open=True),
    **{name: Field("number", 0, 1, low_open=True)
       for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")},
    **{name: Field("number", 0, 1, nullable=True)
       for name in ("attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                    "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout")},
    "initializer_range": Field("number", 0, 10),
    **{name: Field("bool") for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache",
                                        "do_layer_norm_before", "scale_attn_weights", "is_decoder",
                                        "add_cross_attention", "enable_bias")},
    **{name: Field("str") for name in ("model_type", "hidden_act", "activation_function", "position_embedding_type")},
    **{name: Field("str", nullable=True) for name in ("torch_dtype", "dtype")},
}
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "auto"})
ROPE_FIELDS = ("rope_scaling", "rope_parameters")
# The sizes read off the transformers config object, where aliases and defaults are resolved.
SHAPE_ATTRS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size")
# The sizes a config should state: left out, the model type's defaults decide the model's size.
# (head_dim and num_key_value_heads follow from these when left out.)
SIZE_ATTRS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _refuse(message: str, field: str | None = None, hint: str | None = None) -> ModelFormatError:
    return ModelFormatError(message, field=field, hint=hint)


# -- 1. the read -----------------------------------------------------------------------------


def read_config(path: Path) -> dict[str, Any]:
    """Parse `path` as a config.json: bounded, strict, an object at the top."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ModelFormatError(f"cannot read the config: {error.strerror or error}", file=str(path)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelFormatError(f"the config is larger than {MAX_CONFIG_BYTES >> 20} MiB", file=str(path),
                               hint="a config.json is a few KiB; is this the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ModelFormatError(f"the config is not UTF-8 (byte {error.start}: {raw[error.start:error.start + 1]!r})",
                               file=str(path)) from None
    depth = _max_depth(text)
    if depth > MAX_DEPTH:
        raise ModelFormatError(f"the config nests {depth} levels deep (at most {MAX_DEPTH})", file=str(path))
    try:
        config = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                            object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ModelFormatError(f"config is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})",
                               file=str(path)) from None
    except ModelFormatError as error:
        raise error.with_file(str(path)) from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"the config is a JSON {_json_kind(config)}, not an object", file=str(path),
                               hint="pass a Hugging Face config.json")
    return config


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _max_depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings (a cheap scan, no recursion)."""
    depth = deepest = 0
    for char in _STRINGS.sub('""', text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ModelFormatError(f"the config holds an integer of {len(text.lstrip('-'))} digits "
                               f"(at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ModelFormatError(f"the config holds the number {text[:40]}, which overflows a float")
    return value


def _parse_constant(text: str) -> float:
    raise ModelFormatError(f"the config holds {text}, which JSON does not allow")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ModelFormatError(f"the config gives key '{_short(key)}' twice")
        result[key] = value
    return result


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}[type(value)]


def _short(text: str, limit: int = 60) -> str:
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- 2. fields, in plain Python -----------------------------------------------------------


def check_fields(config: dict[str, Any]) -> None:
    """Types and ranges of the shape fields; names that transformers can set as attributes."""
    if "model_type" not in config:
        raise _refuse("config has no 'model_type'", hint="pass a Hugging Face config.json (it names its model_type)")
    for key in config:
        if not key.isidentifier() or key.startswith("__"):
            raise _refuse(f"config field '{_short(key)}' is not a valid field name", field=_short(key))
    for key, spec in FIELDS.items():
        if key in config:
            _check_value(key, config[key], spec)
    for key in ("torch_dtype", "dtype"):
        if isinstance(config.get(key), str) and config[key] not in DTYPES:
            raise _refuse(f"{key} '{_short(config[key])}' is not a dtype", field=key,
                          hint=f"use one of {', '.join(sorted(DTYPES))}")
    if "architectures" in config:
        arch = config["architectures"]
        if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) and a for a in arch)):
            raise _refuse("architectures must be a list of class names", field="architectures")
    for key in ROPE_FIELDS:
        if key in config:
            _check_rope(key, config[key])


def _check_value(key: str, value: Any, spec: Field) -> None:
    def bad() -> ModelFormatError:
        shown = _short(json.dumps(value)) if not isinstance(value, str) else f"'{_short(value)}'"
        return _refuse(f"{key} is {shown}; it must be {spec.describe()}", field=key)

    if value is None:
        if spec.nullable:
            return
        raise bad()
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise bad()
        return
    if spec.kind == "str":
        if not isinstance(value, str) or not value:
            raise bad()
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad()
    if spec.kind == "int" and not isinstance(value, int):
        raise bad()
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        raise bad()
    if spec.high is not None and value > spec.high:
        raise bad()


def _check_rope(key: str, rope: Any) -> None:
    """rope_scaling / rope_parameters: null or an object with a string type and finite numbers
    (flags such as YaRN's `truncate` in gpt-oss's config are true or false)."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise _refuse(f"{key} must be an object or null", field=key)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        raise _refuse(f"{key} type must be a string", field=key)
    for name, value in rope.items():
        if name in ("rope_type", "type") or isinstance(value, bool):
            continue
        numbers = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise _refuse(f"{key}.{_short(name)} must be a number (or a list of numbers)", field=key)
        if name in ("factor", "rope_theta", "original_max_position_embeddings") and not (
            isinstance(value, (int, float)) and value > 0
        ):
            raise _refuse(f"{key}.{name} must be a positive number", field=key)


# -- 3. with transformers -----------------------------------------------------------------


def check_with_transformers(config: dict[str, Any]) -> tuple[Any, Any]:
    """The transformers config object and the model class to build (None: the auto class).

    Runs after `check_fields`; raises UnsupportedModelError for model types and classes
    aviatorc does not build, ModelFormatError for values transformers would choke on."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    model_type = config["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        raise UnsupportedModelError(f"transformers does not know model_type '{_short(model_type)}'",
                                    field="model_type", hint=f"did you mean '{close[0]}'?" if close else None)
    allowed = allowed_architectures(model_type)
    if not allowed:
        raise UnsupportedModelError(f"model_type '{model_type}' has no causal-LM or base model class in "
                                    "transformers, so aviatorc cannot build it", field="model_type")
    config_class = CONFIG_MAPPING[model_type]
    _check_not_encoder_decoder(config, config_class)
    _check_no_shadowing(config, config_class)
    _check_rope_type(config)
    _check_activation(config)
    _check_routing(config)
    model_class = None
    architectures = config.get("architectures") or []
    if architectures:
        name = architectures[0]
        if name not in allowed:
            raise UnsupportedModelError(
                f"architecture '{_short(name)}' is not supported for model_type '{model_type}'",
                field="architectures",
                hint=f"aviatorc builds causal-LM and base model classes: {', '.join(sorted(allowed))}",
            )
        model_class = getattr(transformers, name, None)
        if model_class is None:
            raise UnsupportedModelError(f"this transformers ({transformers.__version__}) has no class '{name}'",
                                        field="architectures")
    check_effective_sizes(effective_sizes(config, config_class), explicit_head_dim=config.get("head_dim") is not None)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as error:
        # transformers' own validation of fields outside FIELDS (its message says which).
        text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ModelFormatError(f"transformers refused the config: {_short(text.strip(), 300)}") from None
    _drop_outside_padding(cfg, stated="pad_token_id" in config)
    return cfg, model_class


def _drop_outside_padding(cfg: Any, *, stated: bool) -> None:
    """A pad_token_id outside the vocabulary (Phi-3's and SmolLM3's class defaults under a smaller
    vocab_size; off-by-one configs) would stop transformers building the embedding. The padding
    index only marks a row for training, so it is dropped, with a warning."""
    pad, vocab = getattr(cfg, "pad_token_id", None), getattr(cfg, "vocab_size", None)
    if not isinstance(pad, int) or not isinstance(vocab, int) or 0 <= pad < vocab:
        return
    origin = "the config's" if stated else f"the '{cfg.model_type}' default"
    _logger.warning(f"pad_token_id {pad} ({origin}) lies outside vocab_size {vocab}: ignored (it only marks the "
                    "padding row for training)")
    cfg.pad_token_id = None


# Sequence mixers other than softmax attention, by the transformers class names that implement them.
# A family mixing them with attention (Falcon-H1, Qwen3-Next, Jamba) is refused as a whole: the IR
# has no scan or recurrent state, and the plan no state cache beside the KV cache.
_MIXERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Mixer$|MambaLayer$"), "state-space (Mamba) layers"),
    (re.compile(r"DeltaNet|DeltaAttention"), "linear-attention (gated DeltaNet) layers"),
    (re.compile(r"LightningAttention"), "linear (lightning) attention layers"),
    (re.compile(r"Rglru|RecurrentBlock"), "recurrent (RG-LRU) layers"),
    (re.compile(r"^Rwkv.*Attention"), "RWKV time-mixing layers"),
    (re.compile(r"^xLSTM(Layer|Backend)"), "xLSTM layers"),
    (re.compile(r"ShortConv"), "short-convolution layers"),
)


def check_layer_kinds(model: Any) -> None:
    """Refuse a model with layers that are not attention, naming their kind and the first one."""
    for path, module in model.named_modules():
        name = type(module).__name__
        for pattern, kind in _MIXERS:
            if pattern.search(name):
                family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
                raise UnsupportedModelError(
                    f"'{family}' has {kind} ({name} at '{path}'), which aviatorc does not support",
                    hint="aviatorc compiles transformer decoders whose layers are all attention")


def effective_sizes(config: dict[str, Any], config_class: type) -> dict[str, int]:
    """The sizes the model will be built with: the config's own (under its class's field
    names: GPT-2's n_embd is hidden_size) or the class defaults, before any is built."""
    return {name: value for name, (_, value, _) in _sizes(config, config_class).items()}


def defaulted_sizes(config: dict[str, Any], config_class: type) -> dict[str, int]:
    """The `SIZE_ATTRS` the config leaves out and the class's defaults fill in, by the field name
    the config would give them under (GPT-2's n_embd)."""
    return {stored: value for name, (stored, value, default) in _sizes(config, config_class).items()
            if default and name in SIZE_ATTRS}


def _sizes(config: dict[str, Any], config_class: type) -> dict[str, tuple[str, int, bool]]:
    """name -> (the config's field name for it, the value, whether the class default gave it)."""
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    defaults = config_class()
    sizes: dict[str, tuple[str, int, bool]] = {}
    for name in SHAPE_ATTRS:
        stored = aliases.get(name, name)
        if stored in config:
            value, default = config[stored], False
        elif name in config:
            value, default = config[name], False
        elif name in ("head_dim", "num_key_value_heads"):
            continue  # their defaults follow the other sizes (hidden / heads, heads), not the class's
        else:
            value, default = _default(defaults, name), True
        if isinstance(value, int) and not isinstance(value, bool):
            sizes[name] = (stored, value, default)
    return sizes


def _default(defaults: Any, name: str) -> Any:
    """The class default of `name`, or None where it has none to give: heterogeneous configs
    (dots3's per-layer ones) raise rather than pick one layer's value."""
    try:
        return getattr(defaults, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and kin
        return None


def warn_defaulted_sizes(config: dict[str, Any], model: Any, source: str) -> None:
    """Log a warning when the model's size came partly from transformers' defaults, not the config."""
    filled = defaulted_sizes(config, type(model.config))
    if not filled:
        return
    count = sum(p.numel() for p in model.parameters())
    values = ", ".join(f"{name} {value:,}" for name, value in filled.items())
    _logger.warning(f"{source}: the config does not set {', '.join(filled)}, so transformers' defaults for "
                    f"'{config['model_type']}' are used ({values}): a {count:,}-parameter model; set them to plan "
                    "the model you mean")


def allowed_architectures(model_type: str) -> frozenset[str]:
    """The classes aviatorc builds for a model type: its causal LM and its base model."""
    return _causal_lm_classes(model_type) | _base_classes(model_type)


def _causal_lm_classes(model_type: str) -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return _class_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))


def _base_classes(model_type: str) -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return _class_names(MODEL_MAPPING_NAMES.get(model_type))


def _class_names(entry: Any) -> frozenset[str]:
    """A transformers auto-mapping entry (a class name, or several) as a set of names."""
    if isinstance(entry, str):
        return frozenset({entry})
    if isinstance(entry, (tuple, list)):
        return frozenset(e for e in entry if isinstance(e, str))
    return frozenset()


def _check_not_encoder_decoder(config: dict[str, Any], config_class: type) -> None:
    """An encoder-decoder (T5, BART as a translator) is refused by name before it is built:
    its export needs decoder inputs, and the partitioner and scheduler know one stack. Its
    causal-LM class (BartForCausalLM, the decoder alone) is fine, and is what is built when
    `architectures` names it or names nothing."""
    model_type = config["model_type"]
    stated = config.get("is_encoder_decoder")
    both = stated if isinstance(stated, bool) else bool(config_class().is_encoder_decoder)
    architectures = config.get("architectures") or []
    causal = _causal_lm_classes(model_type)
    if not both or (causal and (not architectures or architectures[0] in causal)):
        return
    name = architectures[0] if architectures else ", ".join(sorted(_base_classes(model_type))) or model_type
    raise UnsupportedModelError(
        f"{_short(name)} (model_type '{model_type}') is an encoder-decoder architecture, which aviatorc does not "
        "support", field="model_type",
        hint="aviatorc imports decoder-only (causal LM) and encoder-only models")


def _check_no_shadowing(config: dict[str, Any], config_class: type) -> None:
    """A field named like a method or read-only property would replace it on the config."""
    import inspect

    for key in config:
        attr = inspect.getattr_static(config_class, key, None)
        settable = isinstance(attr, property) and attr.fset is not None
        if attr is not None and not settable and (callable(attr) or isinstance(attr, (property, classmethod,
                                                                                      staticmethod))):
            raise _refuse(f"config field '{key}' names a method or property of {config_class.__name__}",
                          field=key, hint="remove it")


def _check_rope_type(config: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", *ROPE_INIT_FUNCTIONS}
    for key in ROPE_FIELDS:
        rope = config.get(key)
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in known:
                raise _refuse(f"{key} type '{_short(str(kind))}' is not one transformers knows", field=key,
                              hint=f"known: {', '.join(sorted(known))}")


# Routing fields a config may state that `transformers` does not read: its model for the type
# routes one way only, so a config asking for another routing would silently build a different
# model. model_type -> field -> the values transformers' model implements.
ROUTING_FIELDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "deepseek_v3": {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,)},
}


def _check_routing(config: dict[str, Any]) -> None:
    """A mixture of experts whose config asks for a routing transformers' model does not implement
    is refused by name, not built with another routing."""
    for field, supported in ROUTING_FIELDS.get(config["model_type"], {}).items():
        if field in config and config[field] not in supported:
            shown = ", ".join(repr(v) for v in supported)
            raise UnsupportedModelError(
                f"router uses {field} {config[field]!r}; supported: {shown} (what transformers' "
                f"'{config['model_type']}' model implements)", field=field)


def _check_activation(config: dict[str, Any]) -> None:
    """hidden_act names one of transformers' activations (an unknown name is a KeyError there)."""
    from transformers.activations import ACT2FN

    for key in ("hidden_act", "activation_function"):
        name = config.get(key)
        if isinstance(name, str) and name not in ACT2FN:
            import difflib

            close = difflib.get_close_matches(name, list(ACT2FN), n=1)
            raise _refuse(f"{key} '{_short(name)}' is not an activation transformers knows", field=key,
                          hint=f"did you mean '{close[0]}'?" if close else f"known: {', '.join(sorted(ACT2FN))}")


def _check_depth(layers: int) -> None:
    if layers > MAX_LAYERS:
        minutes = layers * SECONDS_PER_LAYER / 60
        raise _refuse(f"num_hidden_layers is {layers:,}: a shape-only import traces every layer "
                      f"(about {SECONDS_PER_LAYER} s each), so this one would take about {minutes:,.0f} min; "
                      f"aviatorc imports at most {MAX_LAYERS} layers", field="num_hidden_layers")


def check_effective_sizes(sizes: dict[str, int], *, explicit_head_dim: bool) -> None:
    """The sizes the model will be built with (see `effective_sizes`) must be positive and divide.

    explicit_head_dim: the config sets head_dim itself (Qwen3, Gemma), so heads x head_dim
    need not equal hidden_size."""
    for name, value in sizes.items():
        if value < 1:
            raise _refuse(f"{name} is {value} (from the model type's defaults); it must be at least 1", field=name)
    layers = sizes.get("num_hidden_layers")
    if layers is not None:
        _check_depth(layers)
    hidden, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    kv = sizes.get("num_key_value_heads")
    if hidden and heads and not explicit_head_dim and hidden % heads:
        raise _refuse(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}",
                      field="num_attention_heads", hint="each head takes hidden_size / num_attention_heads features")
    if heads and kv and (kv > heads or heads % kv):
        raise _refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                      field="num_key_value_heads", hint="grouped-query attention shares each kv head among "
                      "an equal number of query heads")


def check_built(model: Any) -> None:
    """The exact parameter count of the model built on the meta device."""
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise _refuse(f"the config describes {count:,} parameters (at most {MAX_PARAMETERS:,})",
                      hint="check the sizes: this is far beyond any released model")

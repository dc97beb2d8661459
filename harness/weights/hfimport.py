"""Turn a Hugging Face config.json into a model spec (local file or hub repo id)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..core.errors import HarnessError
from ..core.specs import ARCHS, MOE_FIELDS, MULTIPLIERS, spec_from_doc
from ..core.yamlio import Doc, parse_json, read_text

# model_type -> (llama.cpp architecture, q/k/v bias when the config does not say)
SUPPORTED = {"llama": ("llama", False), "qwen2": ("qwen2", True), "mistral": ("llama", False),
             "qwen3": ("qwen3", False), "gemma2": ("gemma2", False),
             "gemma3_text": ("gemma3", False), "phi3": ("phi3", False),
             "mixtral": ("llama", False), "granitemoe": ("granitemoe", False),
             "olmoe": ("olmoe", False), "qwen2_moe": ("qwen2moe", True),
             "qwen3_moe": ("qwen3moe", False)}
_COPIED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_theta",
           "rms_norm_eps", "max_position_embeddings")
# Attention hyper-parameters llama.cpp reads only for these architectures (Qwen2's configs carry
# a sliding_window they do not use: use_sliding_window is false).
_WINDOWED = {"gemma2", "gemma3", "phi3"}
_WINDOW_KEYS = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
# Experts under the spec's names, and Mixtral's and Granite's num_local_experts.
_EXPERT_KEYS = {k: k for k in MOE_FIELDS} | {"num_local_experts": "num_experts"}


def spec_dict_from_config(config: dict, name: str, source: str | None, origin: str) -> dict:
    """The spec mapping for one config.json; unsupported architectures are refused."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise HarnessError(f"unsupported model_type {model_type!r}", source=origin,
                           key="model_type", fix="supported: " + ", ".join(SUPPORTED))
    arch, default_bias = SUPPORTED[model_type]
    spec = {"name": name, "source": source, "architecture": arch}
    for key in _COPIED + (_WINDOW_KEYS if arch in _WINDOWED else ()):
        if config.get(key) is not None:
            spec[key] = config[key]
    for key, dense in (("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if config.get(key, dense) not in (dense, None):
            raise HarnessError(f"{key} = {config[key]!r}: some layers are dense", source=origin,
                               key=key, fix="the harness builds experts in every layer; "
                                            "edit the spec by hand if that is close enough")
    if ARCHS[arch].experts != "absent":
        spec |= {ours: config[theirs] for theirs, ours in _EXPERT_KEYS.items()
                 if config.get(theirs) is not None}
    if ARCHS[arch].multipliers:
        spec |= {k: config[k] for k in MULTIPLIERS if config.get(k) is not None}
    spec["attention_bias"] = bool(config.get("attention_bias", default_bias))
    if spec.get("head_dim") and spec["head_dim"] * spec.get("num_attention_heads", 0) == \
            spec.get("hidden_size"):
        spec.pop("head_dim")  # implied; keep specs minimal
    if source is None:
        spec.pop("source")
    # Validate exactly as a spec file would be validated.
    spec_from_doc(Doc(origin, spec), name)
    return spec


def load_config(ref: str) -> tuple[dict, str, str | None]:
    """(config, default spec name, source repo id) from a local path or a hub repo id."""
    path = Path(ref)
    if path.exists() or ref.endswith(".json"):
        if path.is_dir():
            path = path / "config.json"
        text = read_text(path, "config.json")
        name = path.parent.name.lower() or "model"
        source = None
    else:
        text, source = _fetch_from_hub(ref), ref
        name = ref.rsplit("/", 1)[-1].lower()
        path = Path(ref)
    config = parse_json(text, str(path))
    if not isinstance(config, dict):
        raise HarnessError("expected a JSON object", source=str(path),
                           fix="pass a model's config.json")
    return config, name, source


def _fetch_from_hub(repo_id: str) -> str:
    if repo_id.count("/") != 1:
        raise HarnessError(f"{repo_id!r} is neither a local file nor a hub repo id (owner/name)",
                           fix="pass a path to config.json or an id like Qwen/Qwen2.5-0.5B")
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "config.json")).read_text()
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not fetch"
        raise HarnessError(f"could not fetch config.json of {repo_id} from the hub "
                           f"({type(exc).__name__})",
                           fix="check the id and the network, or pass a local config.json"
                           ) from None


def render_spec_yaml(spec: dict) -> str:
    header = f"# Imported from {spec.get('source') or 'a local config.json'} by harness.\n"
    return header + yaml.safe_dump(spec, sort_keys=False)

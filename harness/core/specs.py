"""Model architecture specs in Hugging Face config.json terms, and their tensor plans."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import HarnessError
from .yamlio import (
    Doc,
    check_keys,
    did_you_mean,
    load_yaml_file,
    safe_name,
    want_bool,
    want_float,
    want_int,
    want_mapping,
    want_name,
    want_str,
)


@dataclass(frozen=True)
class Arch:
    """What llama.cpp's loader expects of one architecture."""

    name: str
    qkv_bias: str  # "required", "optional" or "absent"
    qk_norm: bool = False  # an RMS norm over each head's q and k (head_dim weights each)
    post_norms: bool = False  # Gemma 2/3: norms after attention and after the FFN too
    fused: bool = False  # Phi-3: one attn_qkv matrix, gate and up fused in ffn_up
    qk_norm_full: bool = False  # OLMoE: q and k normed over their full width, not per head
    experts: str = "absent"  # "required", "optional" (llama: Mixtral) or "absent"
    shared_expert: bool = False  # Qwen2-MoE: one always-on expert with its own sigmoid gate
    multipliers: bool = False  # Granite: embedding, residual, attention and logit scales
    expert_ff_key: bool = False  # expert width from expert_feed_forward_length (else n_ff)
    rope_neox: bool = False  # RoPE pairs dimension i with i + head_dim/2 (else with i + 1)


# llama.cpp's loaders (src/llama-model.cpp): qwen3 reads attn_q_norm and attn_k_norm per layer
# and no q/k/v biases; gemma2 four norms per layer (post_attention_norm, post_ffw_norm), gemma3
# those and q/k norms; phi3 attn_qkv and an ffn_up of twice the FFN width, no ffn_gate.
# Mistral 7B is the llama architecture. The MoE loaders read a router ffn_gate_inp {n_embd,
# n_expert} and 3-D ffn_{gate,up,down}_exps per layer (Mixtral is llama with experts; granitemoe
# goes through the llama loader plus Granite's four scales; olmoe norms q and k over n_embd;
# qwen2moe adds q/k/v biases and a shared expert with ffn_gate_inp_shexp {n_embd}).
# llama_model_rope_type: llama and granitemoe rotate neighbouring pairs (LLAMA_ROPE_TYPE_NORM),
# the others pairs offset by head_dim/2 (LLAMA_ROPE_TYPE_NEOX).
ARCHS: dict[str, Arch] = {
    "qwen2": Arch("qwen2", qkv_bias="required", rope_neox=True),
    "llama": Arch("llama", qkv_bias="optional", experts="optional"),
    "qwen3": Arch("qwen3", qkv_bias="absent", qk_norm=True, rope_neox=True),
    "gemma2": Arch("gemma2", qkv_bias="absent", post_norms=True, rope_neox=True),
    "gemma3": Arch("gemma3", qkv_bias="absent", qk_norm=True, post_norms=True,
                   rope_neox=True),
    "phi3": Arch("phi3", qkv_bias="absent", fused=True, rope_neox=True),
    "granitemoe": Arch("granitemoe", qkv_bias="absent", experts="required", multipliers=True),
    "olmoe": Arch("olmoe", qkv_bias="absent", qk_norm_full=True, experts="required",
                  rope_neox=True),
    "qwen2moe": Arch("qwen2moe", qkv_bias="required", experts="required", shared_expert=True,
                     expert_ff_key=True, rope_neox=True),
    "qwen3moe": Arch("qwen3moe", qkv_bias="absent", qk_norm=True, experts="required",
                     expert_ff_key=True, rope_neox=True),
}

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
               "logits_scaling")
OPTIONAL_HPARAMS = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                    *MOE_FIELDS, *MULTIPLIERS)

# Upper bound for dimensions: far above any real dense model, low enough to stop typos like 1e12.
MAX_DIM = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer, in config.json terms plus its llama.cpp architecture."""

    name: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    head_dim: int
    source: str | None = None
    # Gemma's attention hyper-parameters (written to the GGUF where set; no effect on shapes)
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts: E experts of width moe_intermediate_size (intermediate_size where
    # unset, as Mixtral, OLMoE and Granite configs give it), k of them per token
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    # Granite's scales (HF names; llama.cpp's embedding/residual/attention/logit scale)
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def content_hash(self) -> str:
        """SHA-256 of the spec's canonical JSON: the cache key's spec part."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self) -> dict:
        """The fields, without optional hyper-parameters left unset (so specs written before
        those existed keep their hash, their cache key and their stored form)."""
        return {k: v for k, v in asdict(self).items()
                if v is not None or k not in OPTIONAL_HPARAMS}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the GGUF file: its llama.cpp name and numpy shape (ggml ne reversed)."""

    name: str
    shape: tuple[int, ...]
    role: str  # embedding, output, attention, ffn, norm, bias, router, expert, shared

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


def tensor_plan(spec: ModelSpec) -> list[TensorPlan]:
    """Every tensor llama.cpp's loader reads for the spec's architecture, in file order."""
    e, v = spec.hidden_size, spec.vocab_size
    plan = [TensorPlan("token_embd.weight", (v, e), "embedding")]
    arch = ARCHS[spec.architecture]
    for i in range(spec.num_hidden_layers):
        b = f"blk.{i}."
        plan.append(TensorPlan(b + "attn_norm.weight", (e,), "norm"))
        if arch.fused:
            plan.append(TensorPlan(b + "attn_qkv.weight", (spec.q_dim + 2 * spec.kv_dim, e),
                                   "attention"))
        else:
            plan += [TensorPlan(b + "attn_q.weight", (spec.q_dim, e), "attention"),
                     TensorPlan(b + "attn_k.weight", (spec.kv_dim, e), "attention"),
                     TensorPlan(b + "attn_v.weight", (spec.kv_dim, e), "attention")]
        plan.append(TensorPlan(b + "attn_output.weight", (e, spec.q_dim), "attention"))
        if arch.qk_norm or arch.qk_norm_full:
            q_n, k_n = ((spec.q_dim, spec.kv_dim) if arch.qk_norm_full
                        else (spec.head_dim, spec.head_dim))
            plan += [TensorPlan(b + "attn_q_norm.weight", (q_n,), "norm"),
                     TensorPlan(b + "attn_k_norm.weight", (k_n,), "norm")]
        if spec.attention_bias:
            plan += [
                TensorPlan(b + "attn_q.bias", (spec.q_dim,), "bias"),
                TensorPlan(b + "attn_k.bias", (spec.kv_dim,), "bias"),
                TensorPlan(b + "attn_v.bias", (spec.kv_dim,), "bias"),
            ]
        plan += _moe_plan(b, spec) if spec.is_moe else _ffn_plan(b, spec, arch)
    plan.append(TensorPlan("output_norm.weight", (e,), "norm"))
    if not spec.tie_word_embeddings:
        plan.append(TensorPlan("output.weight", (v, e), "output"))
    return plan


def _ffn_plan(b: str, spec: ModelSpec, arch: Arch) -> list[TensorPlan]:
    e, f = spec.hidden_size, spec.intermediate_size
    post = [TensorPlan(b + "post_attention_norm.weight", (e,), "norm")] if arch.post_norms else []
    post_ffn = [TensorPlan(b + "post_ffw_norm.weight", (e,), "norm")] if arch.post_norms else []
    gate_up = ([TensorPlan(b + "ffn_up.weight", (2 * f, e), "ffn")] if arch.fused else
               [TensorPlan(b + "ffn_gate.weight", (f, e), "ffn"),
                TensorPlan(b + "ffn_up.weight", (f, e), "ffn")])
    return [*post, TensorPlan(b + "ffn_norm.weight", (e,), "norm"), *gate_up,
            TensorPlan(b + "ffn_down.weight", (e, f), "ffn"), *post_ffn]


def _moe_plan(b: str, spec: ModelSpec) -> list[TensorPlan]:
    """Router, the experts as 3-D tensors (ggml's mul_mat_id picks rows of the chosen ones)
    and Qwen2-MoE's shared expert with its one-row sigmoid gate."""
    e, f, n = spec.hidden_size, spec.expert_width, spec.num_experts
    plan = [TensorPlan(b + "ffn_norm.weight", (e,), "norm"),
            TensorPlan(b + "ffn_gate_inp.weight", (n, e), "router"),
            TensorPlan(b + "ffn_gate_exps.weight", (n, f, e), "expert"),
            TensorPlan(b + "ffn_up_exps.weight", (n, f, e), "expert"),
            TensorPlan(b + "ffn_down_exps.weight", (n, e, f), "expert")]
    if spec.shared_expert_intermediate_size:
        s = spec.shared_expert_intermediate_size
        plan += [TensorPlan(b + "ffn_gate_inp_shexp.weight", (e,), "shared"),
                 TensorPlan(b + "ffn_gate_shexp.weight", (s, e), "shared"),
                 TensorPlan(b + "ffn_up_shexp.weight", (s, e), "shared"),
                 TensorPlan(b + "ffn_down_shexp.weight", (e, s), "shared")]
    return plan


def n_params(spec: ModelSpec) -> int:
    """Parameter count as Hugging Face reports it: every tensor once (a tied one once)."""
    return sum(t.n_elements for t in tensor_plan(spec))


def n_active_params(spec: ModelSpec) -> int:
    """Parameters one token uses, as MoE model cards count them: everything outside the
    experts (embeddings, router and shared expert included) plus k of the E experts."""
    total = n_params(spec)
    if not spec.is_moe:
        return total
    experts = sum(t.n_elements for t in tensor_plan(spec) if t.role == "expert")
    return total - experts + experts * spec.num_experts_per_tok // spec.num_experts


# --- loading -------------------------------------------------------------------------------

_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")
_KNOWN_KEYS = [f.name for f in fields(ModelSpec)]
_REQUIRED = ("architecture", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "vocab_size")
# The synthetic tokenizer needs 3 special tokens, 256 byte tokens and up to 5 more that an
# architecture's vocabulary loader looks up by name (phi3's chat tokens).
MIN_VOCAB = 259 + 5 + 1


def spec_from_doc(doc: Doc, default_name: str) -> ModelSpec:
    """Validate a parsed spec document and build the ModelSpec."""
    data = want_mapping(doc, (), doc.data)
    check_keys(doc, (), data, _KNOWN_KEYS, _REQUIRED)
    arch = data["architecture"]
    if not isinstance(arch, str) or arch not in ARCHS:
        raise doc.error(("architecture",), f"unsupported architecture {arch!r}",
                        fix="supported: " + ", ".join(ARCHS))
    ints = {k: want_int(doc, (k,), data[k], minimum=1, maximum=MAX_DIM)
            for k in _INT_FIELDS if k in data}
    ints["vocab_size"] = want_int(doc, ("vocab_size",), data["vocab_size"], minimum=MIN_VOCAB,
                                  maximum=MAX_DIM)
    ints["max_position_embeddings"] = want_int(
        doc, ("max_position_embeddings",), data.get("max_position_embeddings", 4096),
        minimum=16, maximum=1 << 24)
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    kv_heads = ints.setdefault("num_key_value_heads", heads)
    if "head_dim" not in ints:
        if hidden % heads:
            raise doc.error(("num_attention_heads",),
                            f"{heads} heads do not divide hidden_size {hidden}",
                            fix="choose a divisor of hidden_size or set head_dim")
        ints["head_dim"] = hidden // heads
    if heads % kv_heads:
        raise doc.error(("num_key_value_heads",),
                        f"{kv_heads} KV heads do not divide {heads} attention heads",
                        fix="use a divisor of num_attention_heads")
    bias = want_bool(doc, ("attention_bias",),
                     data.get("attention_bias", ARCHS[arch].qkv_bias == "required"))
    if ARCHS[arch].qkv_bias == "required" and not bias:
        raise doc.error(("attention_bias",), f"architecture {arch} needs q/k/v biases",
                        fix="set attention_bias: true or use architecture: llama")
    if ARCHS[arch].qkv_bias == "absent" and bias:
        raise doc.error(("attention_bias",), f"llama.cpp's {arch} loader reads no q/k/v biases",
                        fix="set attention_bias: false")
    name = want_name(doc, ("name",), data["name"]) if "name" in data else safe_name(default_name)
    source = data.get("source")
    extras = _gemma_fields(doc, data) | _moe_fields(doc, data, ARCHS[arch])
    return ModelSpec(
        name=name, architecture=arch, attention_bias=bias,
        tie_word_embeddings=want_bool(doc, ("tie_word_embeddings",),
                                      data.get("tie_word_embeddings", False)),
        rope_theta=want_float(doc, ("rope_theta",), data.get("rope_theta", 10000.0),
                              minimum=0.0, exclusive_min=True),
        rms_norm_eps=want_float(doc, ("rms_norm_eps",), data.get("rms_norm_eps", 1e-6),
                                minimum=0.0, maximum=1.0, exclusive_min=True),
        source=None if source is None else want_str(doc, ("source",), source),
        **ints, **extras,
    )


def _gemma_fields(doc: Doc, data: dict) -> dict:
    """The optional attention hyper-parameters, validated where given."""
    out: dict = {}
    if data.get("sliding_window") is not None:
        out["sliding_window"] = want_int(doc, ("sliding_window",), data["sliding_window"],
                                         minimum=1, maximum=1 << 24)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(key) is not None:
            out[key] = want_float(doc, (key,), data[key], minimum=0.0, exclusive_min=True)
    return out


def _moe_fields(doc: Doc, data: dict, arch: Arch) -> dict:
    """Experts, validated against what the architecture's loader reads."""
    given = [k for k in MOE_FIELDS + MULTIPLIERS if data.get(k) is not None]
    out: dict = {k: want_int(doc, (k,), data[k], minimum=1, maximum=MAX_DIM)
                 for k in given if k in MOE_FIELDS}
    out |= {k: want_float(doc, (k,), data[k], minimum=0.0, exclusive_min=True)
            for k in given if k in MULTIPLIERS}
    if arch.experts == "required" and "num_experts" not in out:
        raise doc.error(("num_experts",), f"architecture {arch.name} is a mixture of experts",
                        fix="set num_experts and num_experts_per_tok")
    experts = [k for k in given if k in MOE_FIELDS]
    if arch.experts == "absent" and experts:
        raise doc.error((experts[0],), f"llama.cpp's {arch.name} loader reads no experts",
                        fix=f"remove {experts[0]} or use an MoE architecture")
    stray = [k for k in given if k in MULTIPLIERS and not arch.multipliers]
    if stray:
        raise doc.error((stray[0],), f"{arch.name} has no {stray[0]}",
                        fix="remove it, or use architecture: granitemoe")
    if "num_experts" in out:
        if "num_experts_per_tok" not in out:
            raise doc.error(("num_experts_per_tok",), "missing experts per token",
                            fix="set num_experts_per_tok (k of the num_experts experts)")
        if out["num_experts_per_tok"] > out["num_experts"]:
            raise doc.error(("num_experts_per_tok",),
                            f"{out['num_experts_per_tok']} experts per token exceed the "
                            f"{out['num_experts']} experts",
                            fix="set num_experts_per_tok to at most num_experts")
    elif experts:
        raise doc.error((experts[0],), "expert settings without num_experts",
                        fix="set num_experts, or remove " + experts[0])
    if ("shared_expert_intermediate_size" in out) != arch.shared_expert:
        key = "shared_expert_intermediate_size"
        raise doc.error((key,), f"llama.cpp's {arch.name} loader "
                        + ("needs a shared expert" if arch.shared_expert
                           else "reads no shared expert"),
                        fix=f"set {key}" if arch.shared_expert else f"remove {key}")
    return out


def load_spec_file(path: Path | str) -> ModelSpec:
    """Load and validate one spec YAML (a .yaml or .yml file: nothing else is read)."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise HarnessError("a model spec is a .yaml file", source=str(path),
                           fix="name a spec .yaml file, a spec name (harness models) or, where "
                               "a .gguf is taken, a .gguf file")
    return spec_from_doc(load_yaml_file(path, "model spec"), path.stem)


def models_dir() -> Path:
    """The directory of bundled specs ($HARNESS_MODELS_DIR overrides)."""
    env = os.environ.get("HARNESS_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def all_specs(directory: Path | None = None) -> dict[str, ModelSpec]:
    """Every spec in the models directory, by name; duplicate names are an error. Read once
    while no file there changes (a run resolves its models by name dozens of times)."""
    directory = directory or models_dir()
    paths = sorted(directory.glob("*.yaml"))
    stamps = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:  # gone since the glob: read (and refused) below
            info = None
        stamps.append((str(path), info and (info.st_mtime_ns, info.st_size, info.st_ino)))
    return dict(_read_specs(str(directory), tuple(stamps)))


@functools.lru_cache(maxsize=8)
def _read_specs(directory: str, stamps: tuple) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    origin: dict[str, Path] = {}
    for path in (Path(p) for p, _ in stamps):
        spec = load_spec_file(path)
        if spec.name in specs:
            raise HarnessError(f"duplicate model name {spec.name!r} (also in {origin[spec.name]})",
                               source=str(path), key="name", fix="give each spec its own name")
        specs[spec.name], origin[spec.name] = spec, path
    return specs


def looks_like_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml", ".gguf")) or os.sep in ref or "/" in ref


def resolve_spec(ref: str) -> ModelSpec:
    """A spec by name (from the models directory) or by file path."""
    if looks_like_path(ref):
        return load_spec_file(ref)
    specs = all_specs()
    if ref in specs:
        return specs[ref]
    hint = did_you_mean(ref, list(specs))
    known = "known models: " + ", ".join(specs)
    raise HarnessError(f"unknown model {ref!r}", fix=f"{hint} {known}" if hint else known)

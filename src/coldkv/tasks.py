"""Prefect tasks: thin wrappers over the library, with cache keys that make re-runs no-ops.

The flows in ``flows/`` wire these together. Tasks take plain, hashable arguments (a config
path, ids, text) rather than model objects; the model is loaded once per process and memoised.

Cache keys (``cache_key_fn``, never ``INPUTS`` alone, which collides across tasks with equal
arguments, DESIGN §6):

* calibrate: model id + calibration key (texts, codebook settings, token budget) + store root;
* compress:  model id + prompt text hash + codec settings + codebook hash + store root.

A cached result is only trusted while the store still holds what it names: the flows check
with :func:`cache_stored` / :func:`codebooks_stored` and refresh the task cache otherwise, so
deleting a cache and re-running restores it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import timedelta

import coldkv  # noqa: F401
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from coldkv.config import Config, load_config, read_prompts

_MODELS: dict[str, object] = {}
_MODEL_LOCK = threading.Lock()
MLX_LOCK = threading.Lock()
CACHE_EXPIRATION = timedelta(days=30)


def get_model(spec: str):
    """Load a model once per process (thread-safe)."""
    from coldkv.models import load

    with _MODEL_LOCK:
        if spec not in _MODELS:
            _MODELS[spec] = load(spec)
        return _MODELS[spec]


def config_for(config_path: str, overrides: dict | None = None) -> Config:
    """The flow's config, with optional overrides ``{"storage.root": ..., "model": ...}``."""
    cfg = load_config(config_path)
    for key, value in (overrides or {}).items():
        section, _, field = key.partition(".")
        if field:
            sub = getattr(cfg, section).model_copy(update={field: value})
            cfg = cfg.model_copy(update={section: sub})
        else:
            cfg = cfg.model_copy(update={section: value})
    return cfg


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@task(name="model-identity", cache_policy=NO_CACHE)
def model_identity(model_spec: str) -> str:
    """Load the model (memoised) and return its identity hash (weights + config)."""
    lm = get_model(model_spec)
    get_run_logger().info("model %s, id %s", lm.name, lm.model_id[:12])
    return lm.model_id


def _calibrate_key(ctx, params) -> str:
    cfg = config_for(params["config_path"], params.get("overrides"))
    texts = [t for _, t in read_prompts(cfg.calibration.prompts)]
    from coldkv.calibrate import calibration_key

    key = calibration_key(params["model_id"], texts, cfg.codec, cfg.calibration.max_tokens_per_prompt)
    return f"calibrate-{_sha(key + cfg.storage.root)}"


@task(name="calibrate-codebooks", cache_key_fn=_calibrate_key, cache_expiration=CACHE_EXPIRATION, persist_result=True)
def calibrate_codebooks(config_path: str, model_id: str, overrides: dict | None = None) -> str:
    """Ensure the codebook set for the config exists in the store; returns its sha256."""
    from coldkv.compress import ensure_codebooks_for_config, open_store

    cfg = config_for(config_path, overrides)
    lm = get_model(cfg.model)
    log = get_run_logger()
    ref = ensure_codebooks_for_config(lm, open_store(cfg.storage), cfg, progress=log.info)
    log.info("%s codebooks %s in %.1f s", "trained" if ref.trained else "reused", ref.sha[:12], ref.seconds)
    return ref.sha


def _compress_key(ctx, params) -> str:
    cfg = config_for(params["config_path"], params.get("overrides"))
    parts = [params["model_id"], _sha(params["text"]), json.dumps(cfg.codec.model_dump(), sort_keys=True),
             params["book_sha"], cfg.storage.root, str(cfg.max_prompt_tokens)]  # fmt: skip
    return f"compress-{_sha('|'.join(parts))}"


def codebooks_stored(config_path: str, model_id: str, overrides: dict | None = None) -> bool:
    """Whether the store still holds the codebooks this config calibrates (else refresh the task cache)."""
    from coldkv.calibrate import calibration_key
    from coldkv.compress import open_store

    cfg = config_for(config_path, overrides)
    texts = [t for _, t in read_prompts(cfg.calibration.prompts)]
    key = calibration_key(model_id, texts, cfg.codec, cfg.calibration.max_tokens_per_prompt)
    return open_store(cfg.storage).get_ref("cal-" + key[:40]) is not None


def cache_stored(text: str, config_path: str, book_sha: str, overrides: dict | None = None) -> bool:
    """Whether the store still holds this prompt's cache (else refresh the task cache)."""
    from coldkv.compress import cache_id_for, open_store

    cfg = config_for(config_path, overrides)
    lm = get_model(cfg.model)
    cache_id = cache_id_for(lm.model_id, lm.tokenizer.encode(text), cfg.codec, book_sha)
    return open_store(cfg.storage).exists(cache_id)


@task(name="compress-prompt", cache_key_fn=_compress_key, cache_expiration=CACHE_EXPIRATION, persist_result=True)
def compress_prompt(
    prompt_id: str, text: str, config_path: str, model_id: str, book_sha: str, overrides: dict | None = None
) -> dict:
    """Capture, encode and store one prompt. Returns a summary row (id, tokens, bytes, ratio)."""
    from coldkv.compress import cache_id_for, compress_tokens, load_codebooks, open_store, CodebookRef

    cfg = config_for(config_path, overrides)
    lm = get_model(cfg.model)
    store = open_store(cfg.storage)
    tokens = lm.tokenizer.encode(text)
    if cfg.max_prompt_tokens and len(tokens) > cfg.max_prompt_tokens:
        raise ValueError(
            f"prompt {prompt_id!r} has {len(tokens)} tokens, over max_prompt_tokens={cfg.max_prompt_tokens}"
        )
    ref = CodebookRef(book_sha, load_codebooks(store, book_sha), False, 0.0)
    cache_id = cache_id_for(lm.model_id, tokens, cfg.codec, book_sha)
    if store.exists(cache_id):  # stored by an earlier run whose task cache is gone
        m = store.get_manifest(cache_id)
    else:
        with MLX_LOCK:  # one model, one compute stream: threads share I/O, not the model
            m = compress_tokens(lm, store, ref, tokens, cfg.codec, cache_id=cache_id, name=prompt_id)
    row = {
        "prompt": prompt_id,
        "cache_id": m.cache_id,
        "tokens": m.meta["n_tokens"],
        "bytes": m.total_compressed_bytes,
        "fp16_bytes": m.meta["fp16_file_bytes"],
        "ratio": round(m.meta["fp16_file_bytes"] / m.total_compressed_bytes, 2),
    }
    get_run_logger().info("stored %(prompt)s as %(cache_id)s: %(tokens)d tokens, %(bytes)d bytes, %(ratio).1fx", row)
    return row


@task(name="build-report", cache_policy=NO_CACHE)
def build_report_task(config_path: str, out: str | None = None, quick: bool = True,
                      overrides: dict | None = None) -> str:  # fmt: skip
    """Run the compression report; returns the folder holding report.md/json and plots."""
    from coldkv.report import main_report

    cfg = config_for(config_path, overrides)
    out_dir = out or str(cfg.report.out)
    rc = main_report(cfg, out=out_dir, quick=quick)
    if rc:
        raise RuntimeError(f"report failed with status {rc}")
    return out_dir


def task_runner(cfg: Config):
    """The task runner the config names: threads (default), or Dask / Ray if installed."""
    kind, workers = cfg.flow.task_runner, cfg.flow.max_workers
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as exc:
            raise RuntimeError("task_runner 'dask' needs `pip install prefect-dask`") from exc
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1})
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as exc:
        raise RuntimeError("task_runner 'ray' needs `pip install prefect-ray`") from exc
    return RayTaskRunner()

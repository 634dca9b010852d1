"""The ``coldkv`` command line.

    coldkv run                      the whole pipeline on a config (calibrate -> compress -> report)
    coldkv capture  --prompt TEXT   prefill a prompt and summarise its KV cache
    coldkv calibrate                train (or find) the codebooks for a config
    coldkv compress --file DOC      prompt -> stored cache id
    coldkv ls | show ID | rm ID | verify [ID] | gc
    coldkv resume ID --continue TEXT   decode on from a stored cache
    coldkv export ID FILE | import FILE
    coldkv report                   compression ratio and fidelity vs mlx-lm's own caches

Options shared by most commands: ``--config`` (default ``configs/default.yaml``), ``--store``,
``--model`` and ``--preset`` override the config. Bad input prints one line (exit status 2).
"""

from __future__ import annotations

# Must be the first import: preloads OpenBLAS before anything imports mlx.core.
import coldkv  # noqa: F401  isort: skip

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from coldkv import _blas

REPO_ROOT = Path(__file__).resolve().parents[2]


class UserError(Exception):
    """Bad input: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- helpers


def _read_text(args, required: bool = True) -> str | None:
    prompt, file = getattr(args, "prompt", None), getattr(args, "file", None)
    if prompt is not None and file:
        raise UserError("give either --prompt or --file, not both")
    if file:
        path = Path(file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        return path.read_text(encoding="utf-8")
    if prompt is not None:
        return prompt
    if required and not sys.stdin.isatty():
        return sys.stdin.read()
    if required:
        raise UserError("no prompt: pass --prompt TEXT, --file PATH, or pipe text on stdin")
    return None


def default_config_path() -> Path:
    env = os.environ.get("COLDKV_CONFIG")
    if env:
        return Path(env)
    local = Path("configs/default.yaml")
    return local if local.exists() else REPO_ROOT / "configs" / "default.yaml"


def load_cfg(args):
    """The config named by --config, with --store/--model/--preset applied."""
    from coldkv.config import load_config, load_preset

    cfg = load_config(getattr(args, "config", None) or default_config_path())
    updates = {}
    if getattr(args, "store", None):
        root = args.store if "://" in args.store else str(Path(args.store).resolve())
        updates["storage"] = cfg.storage.model_copy(update={"root": root})
    if getattr(args, "model", None):
        updates["model"] = args.model
    if getattr(args, "preset", None):
        from coldkv.config import CodecSettings

        keep = {"kmeans_iters": cfg.codec.kmeans_iters, "seed": cfg.codec.seed}
        updates["codec"] = CodecSettings(**{**load_preset(args.preset), **keep})
    return cfg.model_copy(update=updates) if updates else cfg


def progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        transient=True, disable=not sys.stderr.isatty(), console=_console(stderr=True),
    )  # fmt: skip


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


@contextmanager
def prefill_progress(total: int, what: str = "prefill"):
    """A rich progress bar on stderr; yields a ``progress(done, total)`` callback."""
    with progress_bar() as prog:
        task = prog.add_task(what, total=total)
        yield lambda done, _total: prog.update(task, completed=done)


def info(msg: str) -> None:
    print(msg, file=sys.stderr)


def _load_model(spec: str):
    from coldkv.models import load

    t0 = time.perf_counter()
    lm = load(spec)
    info(f"loaded {lm.name} in {time.perf_counter() - t0:.1f} s")
    return lm


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"


# ----------------------------------------------------------------------------- commands


def cmd_capture(args) -> int:
    from coldkv.capture import capture

    text = _read_text(args)
    lm = _load_model(args.model or "default")
    tokens = lm.tokenizer.encode(text)
    t0 = time.perf_counter()
    with prefill_progress(len(tokens)) as cb:
        cap = capture(lm.model, tokens, chunk=args.chunk, context_length=lm.context_length, progress=cb)
    seconds = time.perf_counter() - t0
    T, L = cap.num_tokens, len(cap.layers)
    fp16 = L * 2 * cap.n_kv_heads * T * cap.head_dim * 2
    print(f"model      {lm.name}  ({Path(lm.source).name}, id {lm.model_id[:12]})")
    print(f"prompt     {T} tokens, prefill {seconds:.2f} s ({T / max(seconds, 1e-9):.0f} tok/s)")
    print(f"KV cache   {L} layers x {cap.n_kv_heads} KV heads x {cap.head_dim} dims "
          f"(GQA: {cap.n_heads} query heads, {cap.n_heads // cap.n_kv_heads} per KV head)")  # fmt: skip
    print(f"fp16 size  {_human(fp16)} ({fp16 // T} bytes/token)")
    print(f"queries    {cap.layers[0].queries.shape[1]} positions per layer, post-RoPE "
          f"({cap.rope.kind}, base {cap.rope.base}, traditional={cap.rope.traditional})")  # fmt: skip
    return 0


def _codebooks(lm, store, cfg):
    from coldkv.compress import ensure_codebooks_for_config

    ref = ensure_codebooks_for_config(lm, store, cfg, progress=info)
    verb = "trained" if ref.trained else "reusing"
    info(f"{verb} codebooks {ref.sha[:12]} ({_human(ref.book.nbytes)}, {ref.seconds:.1f} s)")
    return ref


def cmd_calibrate(args) -> int:
    from coldkv.compress import open_store

    cfg = load_cfg(args)
    lm = _load_model(cfg.model)
    ref = _codebooks(lm, open_store(cfg.storage), cfg)
    print(ref.sha)
    return 0


def cmd_compress(args) -> int:
    from coldkv.compress import compress_tokens, open_store

    cfg = load_cfg(args)
    text = _read_text(args)
    lm = _load_model(cfg.model)
    store = open_store(cfg.storage)
    ref = _codebooks(lm, store, cfg)
    tokens = lm.tokenizer.encode(text)
    with prefill_progress(len(tokens)) as cb:
        m = compress_tokens(lm, store, ref, tokens, cfg.codec, cache_id=args.id, name=args.name or args.id,
                            overwrite=args.overwrite, progress=cb)  # fmt: skip
    ratio = m.meta["fp16_file_bytes"] / m.total_compressed_bytes
    info(f"stored {m.meta['n_tokens']} tokens in {_human(m.total_compressed_bytes)} "
         f"({ratio:.1f}x smaller than the fp16 prompt-cache file)")  # fmt: skip
    print(m.cache_id)
    return 0


def _store(args):
    from coldkv.compress import open_store

    return open_store(load_cfg(args).storage)


def cmd_ls(args) -> int:
    from rich.table import Table

    store = _store(args)
    table = Table(title=f"caches in {store.root}")
    for col in ("id", "name", "tokens", "model", "bytes", "ratio", "created"):
        table.add_column(col, justify="right" if col in ("tokens", "bytes", "ratio") else "left")
    for m in store.list_caches():
        meta = m.meta
        ratio = meta.get("fp16_file_bytes", 0) / max(m.total_compressed_bytes, 1)
        table.add_row(m.cache_id, str(meta.get("name", "")), str(meta.get("n_tokens", "?")),
                      str(meta.get("model", {}).get("name", "?")), _human(m.total_compressed_bytes),
                      f"{ratio:.1f}x", m.created[:19])  # fmt: skip
    _console().print(table)
    return 0


def cmd_show(args) -> int:
    from coldkv.codec import stored_bits

    store = _store(args)
    m = store.get_manifest(args.id)
    meta = m.meta
    geo = meta["geometry"]
    print(f"id          {m.cache_id}  ({meta.get('name')})")
    print(f"model       {meta['model']['name']}  (id {meta['model']['id'][:12]})")
    print(f"tokens      {meta['n_tokens']}")
    print(f"created     {m.created}  coldkv {m.coldkv_version}, format {m.format_version}")
    print(f"codebooks   {meta['codebook'][:12]}")
    c = meta["codec"]
    print(f"codec       keys {c['key_space']}/{c['key_metric']} {c['key_bits']}b/{c['key_sub_dim']}x{c['key_stages']}, "
          f"values {c['value_metric']} {c['value_bits']}b/{c['value_sub_dim']}x{c['value_stages']}, "
          f"window {c['sinks']}+{c['recent']}, retrieval {c['retrieval_fraction']:.0%} {c['retrieval_dtype']}")  # fmt: skip
    print(f"stored      {_human(m.total_compressed_bytes)} in {len(m.shards)} shard(s) "
          f"(raw {_human(m.total_raw_bytes)}); fp16 file {_human(meta['fp16_file_bytes'])} "
          f"-> {meta['fp16_file_bytes'] / m.total_compressed_bytes:.1f}x")  # fmt: skip
    if args.parts:
        tensors, _ = store.get_cache(args.id)
        parts = stored_bits(tensors, meta["codec_meta"], geo["n_layers"], geo["n_kv_heads"], geo["head_dim"])
        for k, v in parts.items():
            print(f"  {k:<16} {v:.3f}" if k == "bits_per_element" else f"  {k:<16} {_human(v)}")
    return 0


def cmd_rm(args) -> int:
    store = _store(args)
    for cid in args.ids:
        store.remove(cid)
        info(f"removed {cid}")
    return 0


def cmd_verify(args) -> int:
    store = _store(args)
    problems = store.verify(args.id)
    for p in problems:
        print(f"{p.kind}: {p}")
    if not problems:
        n = 1 if args.id else len(store.list_caches())
        print(f"ok: {n} cache(s) verified in {store.root}")
    return 1 if any(p.kind not in ("leftover", "incomplete") for p in problems) else 0


def cmd_gc(args) -> int:
    for line in _store(args).gc():
        print(line)
    return 0


def cmd_resume(args) -> int:
    from coldkv.resume import generate, load_cache, plan_resume

    cfg = load_cfg(args)
    store = _store(args)
    manifest = store.get_manifest(args.id)
    lm = _load_model(args.model or manifest.meta["model"].get("source") or cfg.model)
    stored = manifest.meta["tokens"]
    if args.prompt is not None or args.file:
        new = lm.tokenizer.encode(_read_text(args))
    else:
        new = list(stored)
    if args.cont:
        new = new + lm.tokenizer.encode(args.cont)
    plan = plan_resume(stored, new, strict=args.strict)
    t0 = time.perf_counter()
    cache, _ = load_cache(store, args.id, lm)
    info(f"loaded cache {args.id} ({manifest.meta['n_tokens']} tokens) in {time.perf_counter() - t0:.2f} s; {plan.message}")
    last = None
    for resp in generate(lm, cache, plan, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed):
        print(resp.text, end="", flush=True)
        last = resp
    print()
    if last is not None:
        info(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.0f} tok/s, "
             f"generated {last.generation_tokens} tokens at {last.generation_tps:.1f} tok/s")  # fmt: skip
    return 0


def cmd_export(args) -> int:
    from coldkv.resume import export_prompt_cache, load_cache

    store = _store(args)
    manifest = store.get_manifest(args.id)
    lm = _load_model(args.model or manifest.meta["model"].get("source"))
    cache, m = load_cache(store, args.id, lm)
    export_prompt_cache(args.out, cache, lm, m.meta["tokens"])
    info(f"wrote {args.out} ({_human(Path(args.out).stat().st_size)}); use it with "
         f"mlx_lm.generate --prompt-cache-file {args.out}")  # fmt: skip
    return 0


def cmd_import(args) -> int:
    from coldkv.capture import Capture, LayerCapture
    from coldkv.compress import open_store, store_capture
    from coldkv.rope import rope_spec
    import mlx.core as mx

    from coldkv.resume import import_prompt_cache

    cfg = load_cfg(args)
    if not Path(args.file_in).is_file():
        raise UserError(f"file not found: {args.file_in}")
    lm = _load_model(cfg.model)
    text = _read_text(args, required=False)
    layers, tokens = import_prompt_cache(args.file_in, lm.tokenizer.encode(text) if text else None)
    store = open_store(cfg.storage)
    ref = _codebooks(lm, store, cfg)
    attn = lm.model.layers[0].self_attn
    cap = Capture(tokens, [LayerCapture(k, v, None) for k, v in layers], attn.n_heads, layers[0][0].shape[0],
                  layers[0][0].shape[-1], mx.zeros((0,), mx.int32), rope_spec(attn.rope))  # fmt: skip
    m = store_capture(lm, store, ref, cap, cfg.codec, cache_id=args.id, name=args.id, overwrite=args.overwrite)
    print(m.cache_id)
    return 0


def cmd_run(args) -> int:
    from coldkv.pipeline import run_pipeline

    return run_pipeline(args.config or str(default_config_path()), store=args.store, model=args.model)


def cmd_report(args) -> int:
    from coldkv.report import main_report

    cfg = load_cfg(args)
    return main_report(cfg, out=args.out, quick=args.quick)


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coldkv", description="Cold storage for LLM KV caches.")
    p.add_argument("--version", action="version", version=f"coldkv {coldkv.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, model=True):
        sp.add_argument("--config", help="YAML config (default: configs/default.yaml)")
        sp.add_argument("--store", help="store root: a folder or fsspec URL (overrides the config)")
        if model:
            sp.add_argument("--model", help="'default' (SmolLM2-135M GGUF), a .gguf file, an mlx-lm folder or repo id")
        return sp

    def prompt_args(sp):
        sp.add_argument("--prompt", help="prompt text")
        sp.add_argument("--file", help="read the prompt from a file")

    sp = common(sub.add_parser("run", help="the whole pipeline on a config: calibrate, compress, report"))
    sp.set_defaults(func=cmd_run)

    sp = common(sub.add_parser("capture", help="prefill a prompt and summarise its KV cache"))
    prompt_args(sp)
    sp.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    sp.set_defaults(func=cmd_capture)

    sp = common(sub.add_parser("calibrate", help="train (or find) the codebooks for a config"))
    sp.add_argument("--preset", help="codec preset from configs/presets (default, hifi, max)")
    sp.set_defaults(func=cmd_calibrate)

    sp = common(sub.add_parser("compress", help="compress a prompt's KV cache into the store"))
    prompt_args(sp)
    sp.add_argument("--preset", help="codec preset from configs/presets (default, hifi, max)")
    sp.add_argument("--id", help="cache id (default: derived from the content)")
    sp.add_argument("--name", help="a human-readable name to list")
    sp.add_argument("--overwrite", action="store_true", help="replace a cache with the same id")
    sp.set_defaults(func=cmd_compress)

    sp = common(sub.add_parser("ls", help="list stored caches"), model=False)
    sp.set_defaults(func=cmd_ls)
    sp = common(sub.add_parser("show", help="show one stored cache"), model=False)
    sp.add_argument("id")
    sp.add_argument("--parts", action="store_true", help="also read it and split the bytes by part")
    sp.set_defaults(func=cmd_show)
    sp = common(sub.add_parser("rm", help="remove stored caches"), model=False)
    sp.add_argument("ids", nargs="+")
    sp.set_defaults(func=cmd_rm)
    sp = common(sub.add_parser("verify", help="check sizes and hashes of stored caches"), model=False)
    sp.add_argument("id", nargs="?")
    sp.set_defaults(func=cmd_verify)
    sp = common(sub.add_parser("gc", help="clean up after interrupted writes"), model=False)
    sp.set_defaults(func=cmd_gc)

    sp = common(sub.add_parser("resume", help="continue decoding from a stored cache"))
    sp.add_argument("id")
    prompt_args(sp)
    sp.add_argument("--continue", dest="cont", help="text appended to the stored prompt (or to --prompt)")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--strict", action="store_true", help="refuse a prompt that does not extend the whole stored prefix")
    sp.set_defaults(func=cmd_resume)

    sp = common(sub.add_parser("export", help="write a stored cache as an mlx-lm prompt-cache file"))
    sp.add_argument("id")
    sp.add_argument("out", help="output .safetensors file")
    sp.set_defaults(func=cmd_export)

    sp = common(sub.add_parser("import", help="compress an mlx-lm prompt-cache file into the store"))
    sp.add_argument("file_in", metavar="FILE")
    prompt_args(sp)
    sp.add_argument("--id")
    sp.add_argument("--overwrite", action="store_true")
    sp.set_defaults(func=cmd_import)

    sp = common(sub.add_parser("report", help="compression ratio and fidelity vs mlx-lm's own caches"))
    sp.add_argument("--out", help="output folder (default: the config's report.out)")
    sp.add_argument("--quick", action="store_true", help="short prompts, one preset (for CI)")
    sp.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _blas.LOADED is None and _blas.REASON and "not Linux" not in _blas.REASON:
        info(f"coldkv: note: {_blas.REASON}")
    from coldkv.capture import CaptureError
    from coldkv.codec import CodecError
    from coldkv.config import ConfigError
    from coldkv.models import ModelLoadError
    from coldkv.resume import ResumeError
    from coldkv.store import StoreError

    try:
        return args.func(args)
    except (UserError, ModelLoadError, CaptureError, ConfigError, StoreError, ResumeError, CodecError) as exc:
        print(f"coldkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coldkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

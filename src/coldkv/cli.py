"""The ``coldkv`` command line.

    coldkv capture  --model default --prompt "..."   prefill a prompt, summarise its KV cache
    coldkv demo                                       the main job on the default model

Every sub-command prints a one-line error (exit status 2) for bad input instead of a traceback.
"""

from __future__ import annotations

# Must be the first import: preloads OpenBLAS before anything imports mlx.core.
import coldkv  # noqa: F401  isort: skip

import argparse
import sys
import time
from pathlib import Path

from coldkv import _blas

REPO_ROOT = Path(__file__).resolve().parents[2]


class UserError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _read_prompt(args) -> str:
    if getattr(args, "prompt", None) is not None and getattr(args, "file", None):
        raise UserError("give either --prompt or --file, not both")
    if getattr(args, "file", None):
        path = Path(args.file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        return path.read_text(encoding="utf-8")
    if getattr(args, "prompt", None) is not None:
        return args.prompt
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise UserError("no prompt: pass --prompt TEXT, --file PATH, or pipe text on stdin")


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    )


def capture_prompt(model_spec: str, text: str, chunk: int = 512):
    """Load a model, prefill ``text`` with a progress bar; returns (LoadedModel, Capture, seconds)."""
    from coldkv.capture import capture
    from coldkv.models import load

    lm = load(model_spec)
    tokens = lm.tokenizer.encode(text)
    with _progress() as prog:
        task = prog.add_task("prefill", total=len(tokens))
        t0 = time.perf_counter()
        cap = capture(
            lm.model,
            tokens,
            chunk=chunk,
            context_length=lm.context_length,
            progress=lambda done, total: prog.update(task, completed=done),
        )
        seconds = time.perf_counter() - t0
    return lm, cap, seconds


def print_capture_summary(lm, cap, seconds: float) -> None:
    T, L = cap.num_tokens, len(cap.layers)
    fp16 = L * 2 * cap.n_kv_heads * T * cap.head_dim * 2
    print(f"model      {lm.name}  ({Path(lm.source).name}, id {lm.model_id[:12]})")
    print(f"prompt     {T} tokens, prefill {seconds:.2f} s ({T / max(seconds, 1e-9):.0f} tok/s)")
    print(
        f"KV cache   {L} layers x {cap.n_kv_heads} KV heads x {cap.head_dim} dims "
        f"(GQA: {cap.n_heads} query heads, {cap.n_heads // cap.n_kv_heads} per KV head)"
    )
    print(f"fp16 size  {fp16 / 1e6:.2f} MB ({fp16 // T} bytes/token)")
    q = cap.layers[0].queries
    if q is not None:
        print(f"queries    {q.shape[1]} positions captured per layer, post-RoPE ({cap.rope.kind}, base {cap.rope.base})")


def cmd_capture(args) -> int:
    text = _read_prompt(args)
    lm, cap, seconds = capture_prompt(args.model, text, chunk=args.chunk)
    print_capture_summary(lm, cap, seconds)
    return 0


def cmd_demo(args) -> int:
    prompts = sorted((REPO_ROOT / "configs" / "prompts" / "default").glob("*.txt"))
    if not prompts:
        raise UserError("no shipped prompts found under configs/prompts/default")
    text = prompts[0].read_text(encoding="utf-8")
    print(f"capturing {prompts[0].name} on the default model")
    lm, cap, seconds = capture_prompt(args.model, text)
    print_capture_summary(lm, cap, seconds)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coldkv", description="Cold storage for LLM KV caches.")
    p.add_argument("--version", action="version", version=f"coldkv {coldkv.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def model_arg(sp):
        sp.add_argument(
            "--model",
            default="default",
            help="'default' (SmolLM2-135M GGUF), a .gguf file, an mlx-lm folder or repo id",
        )

    sp = sub.add_parser("capture", help="prefill a prompt and summarise its KV cache")
    model_arg(sp)
    sp.add_argument("--prompt", help="prompt text")
    sp.add_argument("--file", help="read the prompt from a file")
    sp.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    sp.set_defaults(func=cmd_capture)

    sp = sub.add_parser("demo", help="the main job on the default model and shipped prompts")
    model_arg(sp)
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _blas.LOADED is None and _blas.REASON and "not Linux" not in _blas.REASON:
        print(f"coldkv: note: {_blas.REASON}", file=sys.stderr)
    from coldkv.capture import CaptureError
    from coldkv.models import ModelLoadError

    try:
        return args.func(args)
    except (UserError, ModelLoadError, CaptureError) as exc:
        print(f"coldkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

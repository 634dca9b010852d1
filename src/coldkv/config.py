"""YAML configuration shared by the CLI and the Prefect flows, validated with pydantic.

A config names the model, the store, the prompts to compress, the calibration set, the codec
settings (or a preset from ``configs/presets/``), storage and flow options. Unknown keys are
errors (a misspelled key never silently falls back to a default)::

    cfg = load_config("configs/default.yaml")

Relative paths in a config are resolved against the folder that holds the config file, so
flows and the CLI agree wherever they are started.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the key and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CodecSettings(_Strict):
    """How a cache is split and coded (see ``coldkv.codec``).

    Keys and values are product-quantized in a whitened, rotated space (z = x M): sub-vectors
    of ``*_sub_dim`` features, ``2**bits`` centroids each, ``*_stages`` residual stages. Bits
    per element of a coded set = stages * bits / sub_dim.
    """

    key_space: Literal["post_rope", "wrope"] = "wrope"
    key_metric: Literal["h", "plain"] = "h"  # h: A2ATS H-weighted; plain: Euclidean
    key_bits: int = Field(8, ge=1, le=12)
    key_sub_dim: int = Field(4, ge=1)
    key_stages: int = Field(1, ge=1, le=4)
    value_metric: Literal["plain", "output"] = "plain"
    value_bits: int = Field(8, ge=1, le=12)
    value_sub_dim: int = Field(4, ge=1)
    value_stages: int = Field(1, ge=1, le=4)
    rotate: bool = True  # principal axes of z, dealt round-robin to sub-vectors (OPQ idea)
    sinks: int = Field(4, ge=0)
    recent: int = Field(32, ge=0)
    retrieval_fraction: float = Field(0.0, ge=0.0, le=1.0)
    retrieval_dtype: Literal["float16", "int8"] = "int8"
    kmeans_iters: int = Field(20, ge=1)
    seed: int = 0

    @property
    def key_bits_per_element(self) -> float:
        return self.key_stages * self.key_bits / self.key_sub_dim

    @property
    def value_bits_per_element(self) -> float:
        return self.value_stages * self.value_bits / self.value_sub_dim

    def codebook_fields(self) -> dict:
        """The settings that determine a codebook (cache-level ones excluded)."""
        keep = (
            "key_space key_metric key_bits key_sub_dim key_stages value_metric value_bits "
            "value_sub_dim value_stages rotate kmeans_iters seed"
        ).split()
        return {k: getattr(self, k) for k in keep}


class PromptSource(_Strict):
    """A folder of ``*.txt`` files (one prompt each) or a JSONL file (one object per line)."""

    path: Path
    jsonl_field: str = "text"
    jsonl_id_field: str | None = "id"
    limit: int | None = Field(None, ge=1)


class CalibrationConfig(_Strict):
    prompts: PromptSource
    max_tokens_per_prompt: int = Field(2048, ge=8)
    query_sample: int | str = "all"


class StorageConfig(_Strict):
    root: str = "store"
    zstd_level: int = Field(10, ge=1, le=22)
    shard_mb: float = Field(64, gt=0)


class FlowConfig(_Strict):
    retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(1.0, ge=0)
    task_runner: Literal["threads", "dask", "ray"] = "threads"
    max_workers: int = Field(1, ge=1)
    cron: str | None = "0 2 * * *"


class ReportConfig(_Strict):
    out: Path = Path("out/report")
    prompt_tokens: int = Field(2048, ge=8)
    continuation_tokens: int = Field(256, ge=2)
    sweep: list[str] = Field(default_factory=lambda: ["default", "hifi", "max"])
    needle: bool = True


class Config(_Strict):
    model: str = "default"
    prompts: PromptSource
    calibration: CalibrationConfig
    codec: CodecSettings = CodecSettings()
    storage: StorageConfig = StorageConfig()
    flow: FlowConfig = FlowConfig()
    report: ReportConfig = ReportConfig()
    max_prompt_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _prompt_files_exist(self):
        for where, src in (("prompts.path", self.prompts), ("calibration.prompts.path", self.calibration.prompts)):
            if not src.path.exists():
                raise ValueError(f"{where}: prompt file or folder not found: {src.path}")
        return self


def load_preset(name: str) -> dict:
    """The codec settings of a shipped preset (``configs/presets/NAME.yaml``)."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown codec preset {name!r}; known presets: {', '.join(known)}")
    data = yaml.safe_load(path.read_text()) or {}
    return data.get("codec", data)


def codec_from_preset(name: str, **overrides) -> CodecSettings:
    try:
        return CodecSettings(**{**load_preset(name), **overrides})
    except ValidationError as exc:
        raise ConfigError(f"preset {name}: {_first_error(exc)}") from None


def _resolve_paths(data: dict, base: Path) -> dict:
    def fix(section: dict | None, key: str):
        if isinstance(section, dict) and isinstance(section.get(key), str):
            p = Path(section[key]).expanduser()
            section[key] = str(p if p.is_absolute() else (base / p).resolve())

    fix(data.get("prompts"), "path")
    fix((data.get("calibration") or {}).get("prompts"), "path")
    fix(data.get("report"), "out")
    storage = data.get("storage")
    if isinstance(storage, dict) and isinstance(storage.get("root"), str) and "://" not in storage["root"]:
        fix(storage, "root")
    return data


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (misspelled?)"
    if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
        return f"{loc}: {msg} (got {json.dumps(err['input'], default=str)})"
    return f"{loc}: {msg}"


def parse_config(data: dict, base: Path, source: str = "<config>") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    data = json.loads(json.dumps(data, default=str))  # deep copy
    codec = data.get("codec")
    if isinstance(codec, dict) and "preset" in codec:
        preset = codec.pop("preset")
        data["codec"] = {**load_preset(preset), **codec}
    try:
        return Config(**_resolve_paths(data, base))
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_error(exc)}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config; raises :class:`ConfigError` with file, key and reason."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data or {}, path.resolve().parent, str(path))


def read_prompts(src: PromptSource) -> list[tuple[str, str]]:
    """``[(prompt_id, text)]`` from a folder of .txt files or a JSONL file, in a stable order."""
    path = src.path
    items: list[tuple[str, str]] = []
    if path.is_dir():
        for f in sorted(path.glob("*.txt")):
            items.append((f.stem, f.read_text(encoding="utf-8")))
    else:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not valid JSON: {exc.msg}") from None
            if src.jsonl_field not in obj:
                raise ConfigError(f"{path}:{n}: no field {src.jsonl_field!r}")
            pid = str(obj.get(src.jsonl_id_field, n)) if src.jsonl_id_field else str(n)
            items.append((pid, str(obj[src.jsonl_field])))
    if not items:
        raise ConfigError(f"no prompts found in {path}")
    return items[: src.limit] if src.limit else items

from pathlib import Path

import pytest
import yaml

from coldkv.config import ConfigError, codec_from_preset, load_config, read_prompts

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> Path:
    (tmp_path / "p").mkdir(exist_ok=True)
    (tmp_path / "p" / "a.txt").write_text("hello")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"prompts": {"path": "p"}, "calibration": {"prompts": {"path": "p"}}}


def test_shipped_configs_and_presets_validate():
    cfg = load_config(REPO / "configs" / "default.yaml")
    assert cfg.model == "default" and cfg.prompts.path.is_dir()
    assert cfg.codec.key_space == "wrope"  # from the preset
    assert cfg.codec.kmeans_iters == 12  # override beside the preset
    for name in ("default", "hifi", "max"):
        s = codec_from_preset(name)
        assert 64 % s.key_sub_dim == 0 and 64 % s.value_sub_dim == 0


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    cfg = load_config(write(tmp_path, {**BASE, "storage": {"root": "st"}}))
    assert cfg.prompts.path == (tmp_path / "p").resolve()
    assert cfg.storage.root == str((tmp_path / "st").resolve())
    cfg = load_config(write(tmp_path, {**BASE, "storage": {"root": "memory://x"}}))
    assert cfg.storage.root == "memory://x"


def test_misspelled_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"codec\.key_bitz: unknown key \(misspelled\?\)"):
        load_config(write(tmp_path, {**BASE, "codec": {"key_bitz": 4}}))


def test_wrong_type_is_named_with_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r'codec\.key_bits: .*integer.*\(got "eight"\)'):
        load_config(write(tmp_path, {**BASE, "codec": {"key_bits": "eight"}}))
    with pytest.raises(ConfigError, match=r"codec\.retrieval_fraction: .*less than or equal to 1"):
        load_config(write(tmp_path, {**BASE, "codec": {"retrieval_fraction": 1.5}}))


def test_missing_prompt_file_and_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="prompts.path: prompt file or folder not found"):
        load_config(write(tmp_path, {**BASE, "prompts": {"path": "nope.jsonl"}}))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="unknown codec preset 'tiny'"):
        load_config(write(tmp_path, {**BASE, "codec": {"preset": "tiny"}}))


def test_read_prompts_from_jsonl_and_bad_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": "x", "text": "one"}\n\n{"id": "y", "text": "two"}\n')
    cfg = load_config(write(tmp_path, {**BASE, "prompts": {"path": "d.jsonl"}}))
    assert read_prompts(cfg.prompts) == [("x", "one"), ("y", "two")]
    f.write_text('{"id": "x", "text": "one"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: not valid JSON"):
        read_prompts(cfg.prompts)

"""The coldkv command line end to end on the default model (in-process, one store)."""


import coldkv  # noqa: F401
import pytest
from conftest import REPO, write_config

from coldkv.cli import main

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    return write_config(tmp, REPO / "configs/prompts/default", tmp / "store")


def test_compress_ls_show_verify_export_import_rm(cfg, capsys, tmp_path):
    c = ["--config", str(cfg)]
    doc = REPO / "configs/prompts/default/document.txt"
    assert main(["compress", *c, "--file", str(doc), "--id", "tides", "--name", "tides"]) == 0
    assert capsys.readouterr().out.strip() == "tides"
    assert main(["ls", *c]) == 0
    out = capsys.readouterr().out
    assert "tides" in out and "SmolLM2" in out
    assert main(["show", *c, "tides", "--parts"]) == 0
    out = capsys.readouterr().out
    assert "bits_per_element" in out and "bulk_codes" in out and "fp16 file" in out
    assert main(["verify", *c]) == 0
    assert "ok: 1 cache(s) verified" in capsys.readouterr().out

    exported = tmp_path / "tides.safetensors"
    assert main(["export", *c, "tides", str(exported)]) == 0
    from mlx_lm.models.cache import load_prompt_cache

    cache, meta = load_prompt_cache(str(exported), return_metadata=True)
    assert len(cache) == 30 and cache[0].offset == len(__import__("json").loads(meta["coldkv_tokens"]))
    assert main(["import", *c, str(exported), "--id", "tides2"]) == 0
    assert capsys.readouterr().out.strip() == "tides2"
    assert main(["rm", *c, "tides2"]) == 0
    assert main(["verify", *c, "tides2"]) == 2  # gone: one-line error, status 2
    assert "tides2" in capsys.readouterr().err


def test_verify_names_a_corrupted_shard(cfg, capsys):
    c = ["--config", str(cfg)]
    assert main(["compress", *c, "--prompt", "A short prompt about the weather in spring.", "--id", "spring"]) == 0
    capsys.readouterr()
    shard = next((cfg.parent / "store" / "caches" / "spring").glob("shard-*.zst"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", *c, "spring"]) == 1
    assert shard.name in capsys.readouterr().out
    assert main(["resume", *c, "spring", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "sha256" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compress", "--prompt", ""], "the prompt is empty"),
        (["compress", "--file", "/no/such/file.txt"], "prompt file not found"),
        (["capture", "--model", "/no/such/model.gguf", "--prompt", "hi"], "model file not found"),
        (["show", "nope"], "nope"),
        (["resume", "nope"], "nope"),
        (["compress", "--preset", "huge", "--prompt", "x"], "unknown codec preset 'huge'"),
    ],
)
def test_bad_input_is_one_line_with_status_2(cfg, capsys, argv, message):
    cmd, rest = argv[0], argv[1:]
    assert main([cmd, "--config", str(cfg), *rest]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") <= 3 and "Traceback" not in err

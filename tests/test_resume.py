import json
import subprocess
import sys

import coldkv  # noqa: F401
import pytest
from conftest import REPO, write_config

from coldkv.resume import ResumeError, plan_resume


def test_plan_reuses_the_whole_prefix_and_refeeds_one_token_when_nothing_is_new():
    p = plan_resume([1, 2, 3], [1, 2, 3, 4, 5])
    assert (p.reuse, p.feed) == (3, [4, 5]) and "reusing all 3 stored tokens, prefilling 2 new tokens" in p.message
    p = plan_resume([1, 2, 3], [1, 2, 3])
    assert (p.reuse, p.feed) == (2, [3])


def test_plan_reuses_the_longest_common_prefix_and_says_so():
    p = plan_resume([1, 2, 3, 4], [1, 2, 9, 9, 9])
    assert (p.reuse, p.feed) == (2, [9, 9, 9])
    assert "diverges from the stored prefix at token 2 of 4: reusing 2 tokens" in p.message
    with pytest.raises(ResumeError, match="diverges from the stored prefix at token 2 of 4; refusing"):
        plan_resume([1, 2, 3, 4], [1, 2, 9], strict=True)


def test_prompt_that_does_not_extend_the_stored_prefix_is_refused():
    with pytest.raises(ResumeError, match="does not extend the stored prefix"):
        plan_resume([1, 2, 3], [7, 2, 3])


@pytest.fixture(scope="module")
def cli_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    # every bulk token in the float16 retrieval set: the restored cache equals the exact one
    # to float16 precision, so greedy decoding must match the exact cache token for token
    hifi = {"retrieval_fraction": 1.0, "retrieval_dtype": "float16"}
    return write_config(tmp, REPO / "configs/prompts/default", tmp / "store", codec=hifi)


def run_cli(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "coldkv.cli", *args], capture_output=True, text=True, cwd=REPO)
    if check and out.returncode:
        raise AssertionError(f"coldkv {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out


@pytest.mark.model
def test_stored_cache_resumes_in_a_new_process_like_the_exact_cache(lm, cli_config):
    from mlx_lm import generate

    from coldkv.cli import main

    text = (REPO / "configs/prompts/default/story.txt").read_text()
    assert main(["compress", "--config", str(cli_config), "--prompt", text, "--id", "story"]) == 0
    out = run_cli("resume", "story", "--config", str(cli_config), "--continue", " The next day", "--max-tokens", "12")
    assert "reusing all" in out.stderr and "prefilling" in out.stderr
    exact = generate(lm.model, lm.tokenizer, lm.tokenizer.encode(text + " The next day"), max_tokens=12)
    assert out.stdout.strip() == exact.strip()


@pytest.mark.model
def test_resume_refuses_a_cache_of_another_model(cli_config):
    manifest = cli_config.parent / "store" / "caches" / "story" / "manifest.json"
    original = manifest.read_text()
    data = json.loads(original)
    data["meta"]["model"]["id"] = "0" * 64
    manifest.write_text(json.dumps(data))
    try:
        out = run_cli("resume", "story", "--config", str(cli_config), "--max-tokens", "2", check=False)
        assert out.returncode == 2
        assert "was built by model" in out.stderr and "not by the loaded" in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        manifest.write_text(original)

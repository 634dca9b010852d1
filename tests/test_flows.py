"""Flow tests on the real default model, under a temporary Prefect API (prefect_test_harness)."""

import sys
from pathlib import Path

import pytest
from conftest import write_config

from coldkv.prefect_env import REPO_ROOT, configure

pytestmark = pytest.mark.model

SHORT = {
    "a": "The harbour master counted the boats twice every morning before the fog lifted.",
    "b": "A small robot learned to water the tomatoes by watching the gardener for a week.",
    "c": "Three trains left the station at noon, each carrying a different kind of cargo.",
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    configure(tmp_path_factory.mktemp("prefect-home"))
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


@pytest.fixture()
def config(tmp_path) -> Path:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name, text in SHORT.items():
        (prompts / f"{name}.txt").write_text(text)
    return write_config(tmp_path, "prompts", "store", flow={"retries": 1, "retry_delay_seconds": 0})


def test_compress_flow_stores_every_prompt_then_is_a_no_op(harness, config, tmp_path):
    from flows.compress import compress_caches

    from coldkv.store import Store

    rows = compress_caches(str(config))
    assert sorted(r["prompt"] for r in rows) == ["a", "b", "c"]
    assert {r["state"] for r in rows} == {"Completed"}
    store = Store(tmp_path / "store")
    assert sorted(m.meta["name"] for m in store.list_caches()) == ["a", "b", "c"]
    assert not store.verify()

    again = compress_caches(str(config))
    assert {r["state"] for r in again} == {"Cached"}
    assert [r["cache_id"] for r in again] == [r["cache_id"] for r in rows]

    # a changed prompt is recompressed, the others stay cached
    (tmp_path / "prompts" / "b.txt").write_text(SHORT["b"] + " It never forgot the basil.")
    third = {r["prompt"]: r for r in compress_caches(str(config))}
    assert third["b"]["state"] == "Completed" and third["b"]["cache_id"] != rows[1]["cache_id"]
    assert third["a"]["state"] == third["c"]["state"] == "Cached"

    # a cache deleted from the store is not trusted from the task cache: it is rebuilt
    store.remove(rows[0]["cache_id"])
    fourth = {r["prompt"]: r for r in compress_caches(str(config))}
    assert fourth["a"]["state"] == "Completed" and store.exists(rows[0]["cache_id"])


def test_poisoned_prompt_fails_alone_with_a_clear_message(harness, config, tmp_path):
    from flows.compress import CompressFailed, compress_caches

    from coldkv.store import Store

    (tmp_path / "prompts" / "huge.txt").write_text("word " * 9000)
    with pytest.raises(CompressFailed, match=r"1 of 4 prompts failed: huge: .*longer than the model's context of 8192"):
        compress_caches(str(config))
    names = sorted(m.meta["name"] for m in Store(tmp_path / "store").list_caches())
    assert names == ["a", "b", "c"]

"""The hierarchical prefix cache (--enable-hierarchical-cache): greedy output equals HF
transformers' while prefixes go to host memory or storage and come back, and storage survives
a restart and never serves a corrupt page."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from srv.engine.hicache import page_keys, seal, unseal
from srv.engine.host_kv import LAYOUTS, HostKVPool
from srv.plugin_manager import load_plugins
from srv.plugins.cache.storage import FileStorage
from srv.sdk.attention import KVCache
from srv.sdk.cache import DEVICE, HOST, HiCacheStorageConfig
from srv.sdk.testing import registered_temporarily
from test_engine import assert_all_kv_returned, hf_greedy, make_engine
from test_server import Server

SHORT = {"max_new_tokens": 4, "temperature": 0}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length,), generator=generator).tolist() for _ in range(count)]


def hicache(storage_dir=None, **flags) -> dict:
    extra = {"enable_hierarchical_cache": True, **flags}
    if storage_dir is not None:
        extra.update(hicache_storage_backend="file",
                     hicache_storage_backend_extra_config=json.dumps({"storage_dir": str(storage_dir)}))
    return extra


def assert_matches_hf(engine, model_dir, batch: list[list[int]], results: list[dict]) -> None:
    """Each output is the start of transformers' greedy continuation (SHORT asks for 4 tokens)."""
    for ids, result in zip(batch, results):
        out = result["output_ids"]
        assert out and out == hf_greedy(str(model_dir), tuple(ids))[:len(out)], f"prompt {ids[:8]}..."


def generate_each(engine, batch: list[list[int]]) -> list[dict]:
    return [engine.generate(input_ids=p, sampling_params=SHORT) for p in batch]


# ---- the host tier -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", load_plugins()[1].names("eviction_policy"))
@pytest.mark.parametrize("write_policy", ["write_through", "write_back", "write_through_selective"])
def test_prefixes_evicted_to_host_come_back_exact(tiny_models, policy, write_policy):
    """Four 60-token prompts through a pool of 150 tokens: each pushes the others out; the
    second round finds them in host memory (write_through_selective only backs up a prefix
    on its second hit, so each prompt is sent twice in a row)."""
    batch = prompts(4, 60, seed=30)
    repeat = 2 if write_policy == "write_through_selective" else 1
    with make_engine(tiny_models["llama"], max_total_tokens=150, radix_eviction_policy=policy,
                     **hicache(hicache_write_policy=write_policy)) as engine:
        for _ in range(2):
            for prompt in batch:
                for _ in range(repeat):
                    result = engine.generate(input_ids=prompt, sampling_params=SHORT)
                    assert_matches_hf(engine, tiny_models["llama"], [prompt], [result])
        stats = engine.status()["hicache"]
        assert stats["host_hit_tokens"] >= 59 * len(batch) // 2, stats
        assert stats["host_to_device_bytes"] > 0 and stats["device_to_host_bytes"] > 0
        assert_all_kv_returned(engine)
        assert engine.status()["hicache"]["host_tokens_in_use"] == 0


def test_batched_requests_and_chunked_prefill_with_host_hits(tiny_models):
    batch = prompts(6, 70, seed=31)
    with make_engine(tiny_models["qwen3"], max_total_tokens=300, chunked_prefill_size=32,
                     **hicache(hicache_mem_layout="page_first")) as engine:
        for _ in range(2):
            results = engine.generate(input_ids=batch, sampling_params=SHORT)
            assert_matches_hf(engine, tiny_models["qwen3"], batch, results)
        assert engine.status()["hicache"]["host_hit_tokens"] > 0
        assert_all_kv_returned(engine)


def test_default_model_with_host_tier(default_model_dir):
    from srv.engine.default_model import default_model_path

    batch = prompts(3, 120, seed=32)
    with make_engine(default_model_path(), max_total_tokens=260, **hicache()) as engine:
        for _ in range(2):
            results = generate_each(engine, batch)
            assert_matches_hf(engine, default_model_dir, batch, [r for r in results])
        assert engine.status()["hicache"]["host_hit_tokens"] >= 119


def test_where_a_node_lives(tiny_models):
    a, b = prompts(2, 100, seed=33)
    with make_engine(tiny_models["llama"], max_total_tokens=120, **hicache()) as engine:
        tree = engine.scheduler.tree
        engine.generate(input_ids=a, sampling_params=SHORT)
        assert tree.location(tree.match_prefix(a)[1]) == DEVICE
        engine.generate(input_ids=b, sampling_params=SHORT)   # a goes to host memory
        node = next(n for n in tree.root.children.values() if n.key[0] == a[0])
        assert tree.location(node) == HOST and tree.match_prefix(a)[0].numel() == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_pool_layouts_round_trip(layout, dtype):
    page, layers, heads, dim = 4, 3, 2, 8
    kv = KVCache(64, layers, heads, dim, dtype)
    for buffer in kv.k_buffers + kv.v_buffers:
        buffer.copy_(torch.randn(buffer.shape).to(dtype))
    pool = HostKVPool(6, page, layers, heads, dim, dtype, layout)
    pages = pool.allocate(2)
    source = torch.arange(8, 16)
    pool.store(pages, kv.stored_rows(source))
    pool.set_page_bytes(pages[1], pool.page_bytes(pages[1]))
    target = torch.arange(40, 48)
    kv.set_stored_rows(target, pool.rows(pages))
    for buffer in kv.k_buffers + kv.v_buffers:
        assert torch.equal(buffer[target].view(torch.uint8), buffer[source].view(torch.uint8))
    assert pool.allocate(5) is None and pool.free_pages == 4


def test_refused_combinations(tiny_models, capsys):
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        make_engine(model, hicache_storage_backend="file")
    with pytest.raises(ValueError, match="disable-radix-cache"):
        make_engine(model, disable_radix_cache=True, **hicache())
    with pytest.raises(ValueError, match="kernel_ascend"):
        make_engine(model, hicache_io_backend="kernel_ascend", **hicache())
    with pytest.raises(SystemExit):   # refused while the flags are read, naming what it needs
        make_engine(model, **hicache(hicache_storage_backend="mooncake"))
    assert "mooncake: needs the Mooncake store client" in capsys.readouterr().err


# ---- storage -------------------------------------------------------------------------------


def test_sealed_pages_detect_corruption():
    key = page_keys("model", list(range(8)), 4)[1]
    sealed = seal(key, b"\x00\x01kv-bytes" * 10)
    assert unseal(key, sealed) == b"\x00\x01kv-bytes" * 10
    assert unseal(key, sealed[:-1]) is None                       # truncated
    assert unseal(key, sealed[:-1] + b"!") is None                # a byte changed
    assert unseal("0" * 64, sealed) is None                       # another page's file
    assert unseal(key, None) is None and unseal(key, b"") is None


def test_page_keys_chain_on_the_whole_prefix():
    a, b = page_keys("m", [1, 2, 3, 4, 5, 6], 2), page_keys("m", [9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[1:] != b[1:]                         # a page's key depends on what came before
    assert page_keys("m", [1, 2, 3, 4], 2) == a[:2] and page_keys("other", [1, 2], 2) != a[:1]


def test_storage_survives_a_restart_and_skips_a_corrupt_page(tiny_models, tmp_path):
    model = tiny_models["llama"]
    first, second = prompts(2, 48, seed=34)
    flags = hicache(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    with make_engine(model, **flags) as engine:
        expected = [r["output_ids"] for r in generate_each(engine, [first, second])]
        fingerprint = engine.scheduler.tree.root_key
    assert len(list(tmp_path.glob("*.kv"))) >= 2 * 47

    # A restarted server finds the first prompt in storage.
    with make_engine(model, **flags) as engine:
        result = engine.generate(input_ids=first, sampling_params=SHORT)
        assert result["output_ids"] == expected[0]
        assert result["meta_info"]["cached_tokens"] == 47
        assert engine.status()["hicache"]["storage_hit_tokens"] == 47

    # One changed byte in the second prompt's 21st page: the 20 pages before it are served.
    keys = page_keys(fingerprint, second[:47], 1)
    damaged = tmp_path / f"{keys[20]}.kv"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with make_engine(model, **flags) as engine:
        result = engine.generate(input_ids=second, sampling_params=SHORT)
        assert result["output_ids"] == expected[1]
        assert result["meta_info"]["cached_tokens"] == 20
        assert engine.status()["hicache"]["storage_corrupt_pages"] == 1

    # Another model's server sharing the directory finds nothing of these.
    with make_engine(tiny_models["qwen3"], **flags) as engine:
        assert engine.generate(input_ids=first, sampling_params=SHORT)["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["one-process", "tp2", "pp2", "tp2-pp2"])
def test_prefixes_dropped_from_host_come_back_from_storage(tiny_models, tmp_path, tp, pp, monkeypatch):
    """A host tier of half the pool: pages pushed out of both tiers are read back from storage,
    and a restart of the same layout finds them there. Split over ranks, rank 0's tiers hold the
    ranks' shares of each page (their key/value heads, their stage's layers) put together, and
    each rank gets its share back."""
    if tp * pp > 1:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the ranks share this machine's cores
    batch = prompts(4, 60, seed=36)
    flags = hicache(tmp_path, hicache_ratio=0.5, hicache_storage_prefetch_policy="wait_complete")
    with make_engine(tiny_models["llama"], max_total_tokens=150, tp_size=tp, pp_size=pp, **flags) as engine:
        for _ in range(2):
            results = generate_each(engine, batch)
            assert_matches_hf(engine, tiny_models["llama"], batch, results)
        stats = engine.status()["hicache"]
        assert stats["storage_hit_tokens"] >= 59 and stats["storage_read_bytes"] > 0, stats
        assert_all_kv_returned(engine)
    with make_engine(tiny_models["llama"], max_total_tokens=150, tp_size=tp, pp_size=pp, **flags) as engine:
        result = engine.generate(input_ids=batch[0], sampling_params=SHORT)
        assert result["meta_info"]["cached_tokens"] == 59
        assert result["output_ids"] == results[0]["output_ids"]


class SlowStorage(FileStorage):
    """A file store whose reads wait until the test lets them go."""

    release = threading.Event()

    def batch_get(self, keys):
        self.release.wait(timeout=30)
        return super().batch_get(keys)


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies(tiny_models, tmp_path, policy):
    model = tiny_models["llama"]
    prompt = prompts(1, 40, seed=35)[0]
    with make_engine(model, **hicache(tmp_path)) as engine:
        expected = engine.generate(input_ids=prompt, sampling_params=SHORT)["output_ids"]
    SlowStorage.release.clear()
    extra = {"storage_dir": str(tmp_path), "prefetch_timeout_base": 0.3, "prefetch_timeout_per_ki_token": 0}
    with registered_temporarily("hicache_storage", "slow-file", SlowStorage):
        with make_engine(model, enable_hierarchical_cache=True, hicache_storage_backend="slow-file",
                         hicache_storage_prefetch_policy=policy,
                         hicache_storage_backend_extra_config=json.dumps(extra)) as engine:
            if policy == "wait_complete":
                threading.Timer(0.5, SlowStorage.release.set).start()
            started = time.monotonic()
            result = engine.generate(input_ids=prompt, sampling_params=SHORT)
            SlowStorage.release.set()
            assert result["output_ids"] == expected
            cached = result["meta_info"]["cached_tokens"]
            if policy == "wait_complete":
                assert cached == 39 and time.monotonic() - started >= 0.5
            else:   # admitted without the pages (at once, or when the timeout ran out)
                assert cached == 0
                if policy == "timeout":
                    assert time.monotonic() - started >= 0.3


def test_server_metrics_and_clear_route(tmp_path):
    store = tmp_path / "store"
    server = Server("--enable-metrics", "--max-total-tokens", "300", "--enable-hierarchical-cache",
                    "--hicache-storage-backend", "file",
                    "--hicache-storage-backend-extra-config", json.dumps({"storage_dir": str(store)}))
    try:
        texts = [f"Story {i}: " + " ".join(["word"] * 150) + f" number {i}" for i in range(2)]
        for _ in range(2):
            for text in texts:
                response = httpx.post(f"{server.base}/generate", timeout=120, json={
                    "text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
                assert response.status_code == 200, response.text
        metrics = httpx.get(f"{server.base}/metrics").text
        host_hits = [line for line in metrics.splitlines()
                     if line.startswith("sglang:hicache_hit_tokens_total") and 'tier="host"' in line]
        assert host_hits and float(host_hits[0].split()[-1]) > 0, metrics
        assert "sglang:hicache_bytes_total" in metrics
        deadline = time.monotonic() + 10
        while not list(store.glob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(store.glob("*.kv"))
        response = httpx.post(f"{server.base}/clear_hicache_storage_backend", timeout=30)
        assert response.status_code == 200 and response.json()["success"]
        assert not list(store.glob("*.kv"))
    finally:
        server.stop()


def test_clear_without_storage_is_refused(tiny_models):
    with make_engine(tiny_models["llama"]) as engine:
        with pytest.raises(ValueError, match="no hierarchical cache storage"):
            engine._run(engine.frontend.control("clear_hicache_storage_backend"))


def test_file_storage_keeps_only_whole_pages(tmp_path):
    store = FileStorage(HiCacheStorageConfig({"storage_dir": str(tmp_path)}))
    key = "a" * 64
    assert store.batch_set([key], [b"x" * 100]) == [True]
    assert not list(tmp_path.glob(".*.part")) and store.batch_get([key, "b" * 64]) == [b"x" * 100, None]
    with pytest.raises(ValueError):
        store.batch_exists(["../escape"])

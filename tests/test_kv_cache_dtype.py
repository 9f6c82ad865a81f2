"""`--kv-cache-dtype fp8_e4m3|fp8_e5m2`: a float8 KV pool with a scale a layer (the attention kit
checks every backend on it), its scales file (`--quantization-param-path`), its size, and the
default model within the stated accuracy bound."""

from __future__ import annotations

import json

import pytest
import torch

import srv
from srv.plugins.cache.kv_dtypes import Float8E4M3, read_kv_scales
from srv.sdk.attention import KVCache
from srv.sdk.testing.quantization import measure_accuracy

# docs/quantization.md's bounds for float8 KV caches on the default model (scales 1.0).
BOUNDS = {"fp8_e4m3": (0.10, 0.90), "fp8_e5m2": (0.20, 0.85)}


def test_a_float8_pool_saturates_and_reads_back_through_its_scales():
    cache = KVCache(4, 1, 1, 4, torch.float8_e4m3fn, k_scales=[2.0], v_scales=[0.5])
    k = torch.tensor([[[1.0, -3.0, 1e6, -1e6]]])
    cache.store(0, torch.tensor([1]), k, k)
    keys = cache.keys(0, torch.tensor([1]), torch.float32)[0, 0]
    assert keys.tolist() == [1.0, -3.0, 448.0 * 2, -448.0 * 2]     # e4m3's largest finite value is 448
    values = cache.values(0, torch.tensor([1]), torch.float32)[0, 0]
    assert values[:2].tolist() == [1.0, -3.0] and values[2] == 448 * 0.5
    assert cache.k_buffers[0].element_size() == cache.v_buffers[0].element_size() == 1


def write_scales(path, layers, dtype="float8_e4m3fn", scale=0.5):
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": dtype, "scaling_factor": {"0": {str(i): scale for i in range(layers)}}}}))
    return path


def test_scales_file_is_read_and_checked(tmp_path):
    assert read_kv_scales(write_scales(tmp_path / "s.json", 3), Float8E4M3.NAMES) == {0: 0.5, 1: 0.5, 2: 0.5}
    with pytest.raises(ValueError, match="holds scales for float8_e5m2, not float8_e4m3fn"):
        read_kv_scales(write_scales(tmp_path / "s.json", 3, "float8_e5m2"), Float8E4M3.NAMES)
    with pytest.raises(ValueError, match="not positive"):
        read_kv_scales(write_scales(tmp_path / "s.json", 3, scale=0), Float8E4M3.NAMES)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        read_kv_scales(tmp_path / "bad.json", Float8E4M3.NAMES)


def test_engine_uses_the_scales_and_refuses_a_short_file(tiny_models, tmp_path):
    """The tiny Llama has three layers: a file for two is refused, naming the missing layer."""
    path = str(tiny_models["llama"])
    with srv.Engine(model_path=path, kv_cache_dtype="fp8_e4m3", max_total_tokens=1024,
                    quantization_param_path=str(write_scales(tmp_path / "s.json", 3, scale=0.25))) as engine:
        cache = engine.runner.kv_cache
        assert cache.dtype == torch.float8_e4m3fn and cache.k_scales == cache.v_scales == [0.25] * 3
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})["output_ids"]
    with pytest.raises(ValueError, match=r"no KV cache scale for layers \[2\]"):
        srv.Engine(model_path=path, kv_cache_dtype="fp8_e4m3", quantization_param_path=str(
            write_scales(tmp_path / "short.json", 2)))


def test_scales_without_a_float8_cache_are_refused(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="--quantization-param-path holds float8 KV cache scales"):
        srv.Engine(model_path=str(tiny_models["llama"]),
                   quantization_param_path=str(write_scales(tmp_path / "s.json", 3)))


def test_a_float8_pool_takes_one_byte_a_value():
    """What the pool is sized by (the default size is a share of free memory over this)."""
    with srv.Engine(kv_cache_dtype="fp8_e5m2", dtype="float32", max_total_tokens=4096) as engine:
        runner = engine.runner
        values = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim
        assert runner.kv_bytes_per_token() == values
        assert all(b.element_size() == 1 for b in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers)


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_default_model_within_the_stated_bound(dtype):
    """docs/quantization.md's bound for each float8 KV cache on the default model, float32
    arithmetic otherwise (the file's own blocks, srv's default weights)."""
    error_bound, agreement_bound = BOUNDS[dtype]
    accuracy = measure_accuracy(srv.Engine, {"dtype": "float32", "kv_cache_dtype": dtype},
                                reference_flags={"dtype": "float32"})
    assert accuracy.top1_logprob_error <= error_bound, accuracy
    assert accuracy.greedy_agreement >= agreement_bound, accuracy


def test_the_default_pool_is_sized_from_available_memory():
    """MemAvailable, not free pages: the page cache a machine filled reading files (a benchmark's
    weights, a GGUF conversion) is memory the KV cache may have."""
    import os

    from srv.engine.model_runner import available_memory_bytes

    with open("/proc/meminfo") as meminfo:
        expected = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    assert abs(available_memory_bytes() - expected) < 256 * 2**20
    assert available_memory_bytes() >= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") - 256 * 2**20

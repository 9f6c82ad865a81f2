"""Cache plugins: eviction policies for the radix cache (`--radix-eviction-policy`) and the KV
cache's storage formats (`--kv-cache-dtype`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_eviction_policies(register):
    register("lru", "srv.plugins.cache.eviction:LRUPolicy",
             description="evict the least recently used prefix first", priority=10)
    register("lfu", "srv.plugins.cache.eviction:LFUPolicy",
             description="evict the least frequently used prefix first (ties: least recent)")


@hookimpl
def srv_register_kv_cache_dtypes(register):
    register("auto", "srv.plugins.cache.kv_dtypes:AutoKVCacheDtype",
             description="the served dtype", priority=10)
    register("fp8_e4m3", "srv.plugins.cache.kv_dtypes:Float8E4M3",
             description="float8 e4m3 with a scale a layer (--quantization-param-path), read back into the "
                         "served dtype")
    register("fp8_e5m2", "srv.plugins.cache.kv_dtypes:Float8E5M2",
             description="float8 e5m2 with a scale a layer (--quantization-param-path), read back into the "
                         "served dtype")

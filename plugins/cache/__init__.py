"""Cache plugins: eviction policies for the radix cache (`--radix-eviction-policy`), the KV
cache's storage formats (`--kv-cache-dtype`), the hierarchical cache's storage backends
(`--hicache-storage-backend`) and the publishers of KV cache events (`--kv-events-config`)."""

import importlib.util

from srv.sdk import Availability, hookimpl

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


# The distributed stores SGLang offers: the client package and the service each needs.
SERVICE_STORES = {
    "mooncake": ("mooncake", "the Mooncake store client (pip install mooncake-transfer-engine), a Mooncake master "
                             "and metadata server, and RDMA or TCP transfer between nodes"),
    "hf3fs": ("hf3fs_fuse", "a DeepSeek 3FS cluster mounted through its FUSE and usrbio client (hf3fs_fuse)"),
    "nixl": ("nixl", "NVIDIA's NIXL transfer library (pip install nixl) with a GPU or RDMA NIC"),
    "aibrix": ("aibrix_kvcache", "AIBrix's KV cache offloading framework (aibrix_kvcache) and its cache cluster"),
    "eic": ("eic", "Volcano Engine's EIC elastic instant cache client and service"),
}


def needs_service(name: str):
    module, what = SERVICE_STORES[name]

    def check() -> Availability:
        if importlib.util.find_spec(module) is None:
            return Availability.no(f"needs {what}")
        return Availability.no(f"{module} is installed, but srv has no client for {name} yet: load one with "
                               "--hicache-storage-backend dynamic")
    return check


@hookimpl
def srv_register_hicache_storage_backends(register):
    register("file", "srv.plugins.cache.storage:FileStorage", priority=10,
             description="a file a page in a directory (extra config storage_dir; survives restarts)")
    register("dynamic", "srv.plugins.cache.storage:DynamicStorage",
             description="the HiCacheStorage class named by the extra config's module_path and class_name")
    for name in SERVICE_STORES:
        register(name, "srv.plugins.cache.storage:service_storage", available=needs_service(name),
                 description=f"SGLang's {name} store: needs its service and client")


@hookimpl
def srv_register_kv_events_publishers(register):
    register("zmq", "srv.plugins.cache.kv_events:ZmqPublisher", priority=10,
             description="a ZMQ PUB socket (endpoint, topic), with a ROUTER socket that replays missed batches "
                         "(replay_endpoint), as vLLM and SGLang publish")
    register("null", "srv.plugins.cache.kv_events:NullPublisher", description="publishes nothing")

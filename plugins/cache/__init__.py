"""Prefix-cache plugins: eviction policies for the radix cache (`--radix-eviction-policy`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_eviction_policies(register):
    register("lru", "srv.plugins.cache.eviction:LRUPolicy",
             description="evict the least recently used prefix first", priority=10)
    register("lfu", "srv.plugins.cache.eviction:LFUPolicy",
             description="evict the least frequently used prefix first (ties: least recent)")

"""The plugin system: entry points, attribution, failures, conflicts, allow- and block-lists."""

from __future__ import annotations

import json

import pytest

from conftest import FakeDistributions, run_srv
from srv.backend_registry import BackendUnavailable, RegistryConflict, UnknownBackend
from srv.plugin_manager import PluginManager
from srv.sdk import Availability, hookimpl

GPU_PLUGIN = """
from srv.sdk import hookimpl, requires_cuda

@hookimpl
def srv_register_attention_backends(register):
    register("gpukernel", "gpu_plugin:Kernel", description="a CUDA-only kernel", available=requires_cuda)
"""

BROKEN_PLUGIN = """
import package_that_does_not_exist
"""


def plugins_json(env=None) -> dict:
    result = run_srv("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_builtin_plugins_load_through_entry_points():
    report = plugins_json()
    builtin = {p["name"]: p for p in report["plugins"] if p["distribution"] == "srv"}
    assert "cache" in builtin
    assert builtin["cache"]["hooks"] == ["srv_register_eviction_policies", "srv_register_hicache_storage_backends",
                                         "srv_register_kv_cache_dtypes", "srv_register_kv_events_publishers"]
    policies = {b["name"]: b for b in report["backends"]["eviction_policy"]}
    assert set(policies) >= {"lru", "lfu"}
    assert policies["lru"]["available"] and policies["lru"]["distribution"] == "srv"
    assert report["failures"] == []


def test_plugins_text_listing_names_every_family():
    result = run_srv("plugins")
    assert result.returncode == 0
    for family in ("attention", "sampling", "eviction_policy", "schedule_policy", "load_format"):
        assert f"  {family} (" in result.stdout
    assert "lru  available  (srv)" in result.stdout


def test_third_party_plugin_is_listed_and_its_unavailability_explained(fake_dists: FakeDistributions):
    fake_dists.add("srv-gpu-kernels", {"gpu": "gpu_plugin"}, {"gpu_plugin": GPU_PLUGIN}, version="2.3")
    report = plugins_json(fake_dists.env)
    plugin = next(p for p in report["plugins"] if p["distribution"] == "srv-gpu-kernels")
    assert plugin["version"] == "2.3" and plugin["hooks"] == ["srv_register_attention_backends"]
    kernel = next(b for b in report["backends"]["attention"] if b["name"] == "gpukernel")
    assert kernel == {"name": "gpukernel", "description": "a CUDA-only kernel", "available": False,
                      "reason": "needs CUDA; torch sees no GPU", "priority": 0, "plugin": "gpu",
                      "distribution": "srv-gpu-kernels"}


def test_choosing_an_unavailable_backend_exits_with_its_reason(fake_dists: FakeDistributions):
    fake_dists.add("srv-gpu-kernels", {"gpu": "gpu_plugin"}, {"gpu_plugin": GPU_PLUGIN})
    result = run_srv("launch", "--attention-backend", "gpukernel", env=fake_dists.env)
    assert result.returncode == 2
    assert "gpukernel: needs CUDA; torch sees no GPU" in result.stderr


def test_unknown_backend_exits_2_listing_installed_names():
    result = run_srv("launch", "--radix-eviction-policy", "nope")
    assert result.returncode == 2
    assert "unknown eviction_policy backend 'nope'" in result.stderr
    assert "installed: lfu, lru" in result.stderr


def test_a_plugin_that_fails_to_import_is_reported_and_does_not_break_the_rest(fake_dists: FakeDistributions):
    fake_dists.add("srv-broken", {"broken": "broken_plugin"}, {"broken_plugin": BROKEN_PLUGIN})
    report = plugins_json(fake_dists.env)
    [failure] = report["failures"]
    assert failure["distribution"] == "srv-broken" and failure["plugin"] == "broken"
    assert "ModuleNotFoundError" in failure["error"] and "package_that_does_not_exist" in failure["error"]
    assert {b["name"] for b in report["backends"]["eviction_policy"]} >= {"lru", "lfu"}
    # A launch that does not choose its backends gets past plugin loading to the argument checks ...
    assert "--cpu-offload-gb is not supported yet" in run_srv("launch", "--cpu-offload-gb", "2",
                                                            env=fake_dists.env).stderr
    # ... while choosing a backend it would have provided names the failure.
    result = run_srv("launch", "--attention-backend", "brokenkernel", env=fake_dists.env)
    assert result.returncode == 2
    assert "srv-broken" in result.stderr and "package_that_does_not_exist" in result.stderr


def test_two_plugins_registering_one_name_is_an_error_naming_both(fake_dists: FakeDistributions):
    source = """
    from srv.sdk import hookimpl

    @hookimpl
    def srv_register_eviction_policies(register):
        register("fifo", "collections:deque")
    """
    fake_dists.add("srv-evict-a", {"evict_a": "evict_a"}, {"evict_a": source})
    fake_dists.add("srv-evict-b", {"evict_b": "evict_b"}, {"evict_b": source})
    for command in (("plugins",), ("launch",)):
        result = run_srv(*command, env=fake_dists.env)
        assert result.returncode != 0
        assert "'fifo' is registered twice" in result.stderr
        assert "srv-evict-a" in result.stderr and "srv-evict-b" in result.stderr


def test_allow_list_and_block_list(fake_dists: FakeDistributions):
    fake_dists.add("srv-gpu-kernels", {"gpu": "gpu_plugin"}, {"gpu_plugin": GPU_PLUGIN})
    loaded = lambda extra: {p["name"] for p in plugins_json({**fake_dists.env, **extra})["plugins"]}
    assert {"gpu", "cache"} <= loaded({})
    assert loaded({"SRV_PLUGINS": "gpu"}) == {"gpu"}
    assert loaded({"SRV_PLUGINS": "srv-gpu-kernels,cache"}) == {"gpu", "cache"}
    assert loaded({"SRV_PLUGINS": ""}) == set()
    assert "gpu" not in loaded({"SRV_BLOCK_PLUGINS": "srv-gpu-kernels"})
    assert "cache" not in loaded({"SRV_BLOCK_PLUGINS": "cache"})


class InProcessPlugin:
    @hookimpl
    def srv_register_eviction_policies(self, register):
        register("mru", "srv.plugins.cache.eviction:LRUPolicy", priority=100,
                 available=lambda: Availability.no("switched off for this test"))


def test_registry_choose_prefers_available_backends_by_priority():
    manager = PluginManager()
    manager.load_entry_points()
    manager.register(InProcessPlugin(), "in-process", distribution="tests")
    registry = manager.build_registry()
    assert registry.choose("eviction_policy", None).name == "lru"
    assert registry.choose("eviction_policy", "lfu").name == "lfu"
    with pytest.raises(BackendUnavailable, match="mru: switched off for this test"):
        registry.choose("eviction_policy", "mru")
    with pytest.raises(UnknownBackend, match="installed: lfu, lru, mru"):
        registry.choose("eviction_policy", "nope")
    manager.register(type("Again", (InProcessPlugin,), {})(), "again", distribution="tests-again")
    with pytest.raises(RegistryConflict, match="tests.*tests-again"):
        manager.build_registry()


def test_registered_factories_build_their_backends():
    manager = PluginManager()
    manager.load_entry_points()
    registry = manager.build_registry()
    lfu = registry.choose("eviction_policy", "lfu").create()

    class Node:
        def __init__(self, hits, last):
            self.hit_count, self.last_access_time, self.num_tokens = hits, last, 1

    nodes = [Node(3, 1.0), Node(1, 5.0), Node(1, 2.0)]
    assert sorted(nodes, key=lfu.eviction_key) == [nodes[2], nodes[1], nodes[0]]


class FlagsAndRoutesPlugin:
    @hookimpl
    def srv_add_launch_arguments(self, parser):
        parser.add_argument("--my-kernel-tile", type=int, default=64, help="tile size of my kernel")

    @hookimpl
    def srv_register_routes(self, register):
        register("/my-plugin/status", self.status, methods=["GET"])

    async def status(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"ok": True})


def test_plugins_add_their_own_launch_flags_and_routes():
    from srv.args.parser import build_launch_parser, parse_launch_args

    manager = PluginManager()
    manager.load_entry_points()
    manager.register(FlagsAndRoutesPlugin(), "flags-and-routes", distribution="srv-my-kernel")
    registry = manager.build_registry()
    assert parse_launch_args(["--my-kernel-tile", "128"], manager, registry).my_kernel_tile == 128
    assert "plugin flags-and-routes (srv-my-kernel)" in build_launch_parser(manager, registry).format_help()
    [(path, endpoint, methods)] = manager.routes()
    assert (path, methods) == ("/my-plugin/status", ["GET"])

    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    app = Starlette(routes=[Route(path, endpoint, methods=methods)])
    assert TestClient(app).get("/my-plugin/status").json() == {"ok": True}


def test_sdk_availability_helpers_say_what_is_missing():
    from srv.sdk import all_of, requires_cuda, requires_packages

    assert requires_packages("json", "pluggy")().ok
    missing = requires_packages("json", "no_such_module_xyz")()
    assert not missing.ok and missing.reason == "needs the Python package(s) no_such_module_xyz (not installed)"
    combined = all_of(requires_cuda, requires_packages("no_such_module_xyz"))()
    assert combined.reason == "needs CUDA; torch sees no GPU; needs the Python package(s) no_such_module_xyz (not installed)"
    assert all_of(requires_packages("json"))().ok


def test_a_plugin_for_another_sdk_version_is_refused_with_both_versions(fake_dists: FakeDistributions):
    from srv.sdk import API_VERSION

    source = GPU_PLUGIN.replace("from srv.sdk import hookimpl, requires_cuda",
                                "from srv.sdk import hookimpl, requires_cuda\nSRV_SDK_VERSION = '>=9.0'")
    fake_dists.add("srv-future", {"future": "future_plugin"}, {"future_plugin": source})
    fake_dists.add("srv-bad-range", {"badrange": "bad_range_plugin"},
                   {"bad_range_plugin": "SRV_SDK_VERSION = 'whatever'\n"})
    report = plugins_json(fake_dists.env)
    failures = {f["distribution"]: f["error"] for f in report["failures"]}
    assert failures["srv-future"] == f"needs srv SDK >=9.0, but this srv provides SDK {API_VERSION}"
    assert "not a version range" in failures["srv-bad-range"]
    assert "gpukernel" not in {b["name"] for b in report["backends"]["attention"]}

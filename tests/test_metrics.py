"""Prometheus metrics and the logging flags."""

from __future__ import annotations

import json
import threading
import time
from argparse import Namespace
from concurrent import futures

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from srv.server.metrics import token_buckets
from srv.server.request_log import RequestLog
from srv.server.tracing import RequestTracer
from test_engine import make_engine
from test_server import Server, free_port


def scrape(server: Server) -> dict:
    text = httpx.get(f"{server.base}/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, suffix: str = "", **labels) -> list:
    return [s for s in family.samples if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items())]


@pytest.fixture(scope="module")
def metrics_server():
    server = Server("--enable-metrics", "--bucket-time-to-first-token", "0.5", "1", "5",
                    "--bucket-inter-token-latency", "0.01", "0.1", "1",
                    "--collect-tokens-histogram", "--prompt-tokens-buckets", "tse", "16", "2", "4",
                    "--generation-tokens-buckets", "custom", "2", "4", "8",
                    "--tokenizer-metrics-allowed-custom-labels", "team",
                    "--decode-log-interval", "5", "--log-requests", "--log-requests-level", "1",
                    "--enable-request-time-stats-logging")
    yield server
    server.stop()


def test_metrics_after_real_traffic(metrics_server):
    server = metrics_server
    results = []
    for i in range(5):
        headers = {"x-custom-labels": json.dumps({"team": "a", "secret": "x"})} if i < 2 else {}
        response = httpx.post(f"{server.base}/generate", headers=headers, timeout=60, json={
            "text": f"The secret prompt number {i}", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        results.append(response.json())
    families = scrape(server)
    requests = families["sglang:num_requests"]
    assert sum(s.value for s in samples(requests, "_total")) == 5
    assert sum(s.value for s in samples(requests, "_total", team="a")) == 2
    assert all("secret" not in s.labels for f in families.values() for s in f.samples)
    generated = sum(s.value for s in samples(families["sglang:generation_tokens"], "_total"))
    assert generated == sum(r["meta_info"]["completion_tokens"] for r in results) == 30
    prompt = sum(s.value for s in samples(families["sglang:prompt_tokens"], "_total"))
    assert prompt == sum(r["meta_info"]["prompt_tokens"] for r in results)
    ttft_buckets = [s.labels["le"] for s in samples(families["sglang:time_to_first_token_seconds"], "_bucket", team="")]
    assert ttft_buckets == ["0.5", "1.0", "5.0", "+Inf"]
    assert samples(families["sglang:time_to_first_token_seconds"], "_count", team="")[0].value == 3
    itl_count = samples(families["sglang:inter_token_latency_seconds"], "_count", team="")[0].value
    assert itl_count == 3 * 5
    prompt_buckets = [s.labels["le"] for s in samples(families["sglang:prompt_tokens_histogram"], "_bucket", team="")]
    assert prompt_buckets == ["12.0", "14.0", "16.0", "18.0", "20.0", "+Inf"]
    generation = samples(families["sglang:generation_tokens_histogram"], "_bucket", team="")
    assert [(s.labels["le"], s.value) for s in generation] == [("2.0", 0), ("4.0", 0), ("8.0", 3), ("+Inf", 3)]
    assert samples(families["sglang:num_running_reqs"])[0].value == 0
    assert 0 <= samples(families["sglang:token_usage"])[0].value <= 1
    assert samples(families["sglang:cache_hit_rate"])


def test_logs_follow_the_flags(metrics_server):
    server = metrics_server
    httpx.post(f"{server.base}/generate", timeout=60, json={
        "text": "Log me please", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}})
    time.sleep(0.5)
    output = "".join(server.output)
    request_lines = [line for line in output.splitlines() if "request /generate" in line]
    assert request_lines and all("sampling_params" in line for line in request_lines)
    assert "Log me please" not in output and "secret prompt" not in output   # level 1: no prompt text
    assert any("finished (length): prompt" in line and "ttft" in line for line in output.splitlines())
    decode_lines = [line for line in output.splitlines() if "decode:" in line and "tok/s" in line]
    assert decode_lines and all("KV" in line and "cache hit rate" in line for line in decode_lines)


def test_custom_labels_are_ignored_unless_allowed():
    server = Server("--enable-metrics", "--skip-server-warmup")
    try:
        httpx.post(f"{server.base}/generate", headers={"x-custom-labels": json.dumps({"team": "a"})}, timeout=60,
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        families = scrape(server)
        assert all(set(s.labels) <= {"model_name", "le"} for s in families["sglang:num_requests"].samples)
    finally:
        server.stop()


@pytest.mark.parametrize("level, shown", [
    (0, {"model": "m", "stream": False}),
    (1, {"model": "m", "stream": False, "max_tokens": 5}),
    (2, {"model": "m", "stream": False, "max_tokens": 5, "prompt": "x" * 2048 + "..."}),
    (3, {"model": "m", "stream": False, "max_tokens": 5, "prompt": "x" * 3000}),
])
def test_request_log_levels(level, shown):
    log = RequestLog(Namespace(log_requests=True, log_requests_level=level, crash_dump_folder=None,
                               enable_request_time_stats_logging=False))
    assert log._shown({"model": "m", "stream": False, "max_tokens": 5, "prompt": "x" * 3000}) == shown


def test_token_bucket_rules():
    assert token_buckets(["tse", "1000", "2", "8"]) == [984, 992, 996, 998, 1000, 1002, 1004, 1008, 1016]
    assert token_buckets(["custom", "50", "10", "100"]) == [10, 50, 100]
    assert token_buckets(None) == token_buckets(["default"])
    for bad in (["tse", "1000", "2"], ["custom"], ["weird", "1"], ["custom", "x"]):
        with pytest.raises(ValueError):
            token_buckets(bad)


def test_a_bad_bucket_rule_stops_the_launch():
    from conftest import run_srv

    result = run_srv("launch", "--enable-metrics", "--prompt-tokens-buckets", "tse", "1", "2")
    assert result.returncode == 2 and "tse" in result.stderr


def test_tracing_without_opentelemetry_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name.startswith("opentelemetry") else real(name))
    with pytest.raises(RuntimeError, match=r"pip install 'srv\[tracing\]'"):
        RequestTracer(Namespace(oltp_traces_endpoint="localhost:4317"))


def test_traces_reach_an_otlp_collector():
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = free_port()
    collector.add_insecure_port(f"127.0.0.1:{port}")
    collector.start()
    server = Server("--enable-trace", "--oltp-traces-endpoint", f"127.0.0.1:{port}", "--skip-server-warmup")
    try:
        httpx.post(f"{server.base}/generate", timeout=60, json={"text": "trace me", "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        deadline = time.monotonic() + 15
        while not received and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.stop()
        collector.stop(0)
    spans = [span for request in received for rs in request.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    assert [span.name for span in spans] == ["srv.request"]
    attributes = {a.key: a.value for a in spans[0].attributes}
    assert attributes["srv.completion_tokens"].int_value == 3
    assert spans[0].end_time_unix_nano > spans[0].start_time_unix_nano


def test_crash_on_nan_stops_the_engine(tiny_models):
    with make_engine(tiny_models["llama"], crash_on_nan="true",
                     json_model_override_args='{"rms_norm_eps": -1e30}') as engine:
        with pytest.raises(ValueError, match="NaN in the logits"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})


def test_nan_detection_logs_the_request_and_samples_past_the_nan(tiny_models, caplog):
    """--enable-nan-detection: logits holding a NaN (every one, here: a negative norm epsilon)
    are logged with their request and sampled with each NaN as -1e5, so the request ends."""
    with make_engine(tiny_models["llama"], enable_nan_detection=True,
                     json_model_override_args='{"rms_norm_eps": -1e30}') as engine:
        with caplog.at_level("WARNING", logger="srv"):
            result = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0,
                                                                           "ignore_eos": True})
    assert len(result["output_ids"]) == 2
    assert any("NaN in the logits of requests" in r.getMessage() and "--enable-nan-detection" in r.getMessage()
               for r in caplog.records)

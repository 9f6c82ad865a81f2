"""No input crashes the server, nothing blocks the queue, the event loop never stalls.

A server with --api-key and --enable-metrics takes hostile bodies one by one (each a 4xx error
object, the server still serving) and a storm of mixed traffic from another process
(tests/storm.py); the scheduler's failure handling and admission are driven directly; the
request parsers are fuzzed; schemathesis checks the served OpenAPI document against the routes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import srv
from srv.args.parser import build_launch_parser, options_to_argv
from srv.engine.build import build_scheduler
from srv.engine.params import MAX_N
from srv.engine.request import Req
from srv.engine.scheduler_loop import SchedulerLoop
from srv.plugin_manager import load_plugins
from srv.sdk.sampling import SamplingParams
from storm import broke, hostile_bodies
from test_server import MODEL, Server, free_port

API_KEY = "storm-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STORM = Path(__file__).with_name("storm.py")


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY, "--enable-metrics")
    yield server
    server.stop()


def post(server: Server, path: str, content: bytes, method: str = "POST", **headers: str) -> httpx.Response:
    return httpx.request(method, server.base + path, content=content, timeout=120,
                         headers={"content-type": "application/json", **AUTH, **headers})


def is_error_object(response: httpx.Response, status: int) -> bool:
    error = response.json()["error"]
    return response.status_code == status and error["code"] == status and bool(error["message"]) \
        and set(error) == {"message", "type", "param", "code"}


# ---- each defect of the issue, and the hostile bodies of the storm -------------------------------


@pytest.mark.parametrize("method, path, body, headers", hostile_bodies(49152),
                         ids=lambda v: v[:40].decode(errors="replace") if isinstance(v, bytes) else None)
def test_a_hostile_body_is_a_4xx_error_object_and_the_server_keeps_serving(server, method, path, body, headers):
    response = post(server, path, body, method, **headers)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert is_error_object(response, response.status_code)
    assert server.process.poll() is None
    ok = post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())
    assert ok.status_code == 200


def test_a_token_id_outside_the_vocabulary_is_refused(server):
    response = post(server, "/v1/completions", json.dumps({"prompt": [49152], "max_tokens": 1}).encode())
    assert is_error_object(response, 400) and "outside the vocabulary of 49152 tokens" in response.json()["error"]["message"]


def test_max_tokens_past_the_context_is_refused_in_sglangs_words(server):
    response = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode())
    assert is_error_object(response, 400)
    assert response.json()["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total of")


def test_n_beyond_its_bound_and_bodies_that_are_not_json(server):
    response = post(server, "/v1/completions", json.dumps({"prompt": "hi", "n": MAX_N + 1}).encode())
    assert is_error_object(response, 400) and response.json()["error"]["param"] == "n"
    assert is_error_object(post(server, "/v1/completions", b'{"prompt": "hi"}', **{"content-type": "text/plain"}), 415)
    assert is_error_object(post(server, "/v1/completions", b"", "GET"), 405)
    assert is_error_object(post(server, "/v1/nothing", b"{}"), 404)
    big = b'{"prompt": "' + b"a" * (4 * 2**20) + b'"}'
    assert is_error_object(post(server, "/v1/completions", big), 413)


def test_deep_nesting_and_lone_surrogates_are_400s_on_a_kept_connection(server):
    with httpx.Client(base_url=server.base, headers={**AUTH, "content-type": "application/json"}, timeout=60) as client:
        nested = client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert is_error_object(nested, 400) and nested.headers.get("connection") != "close"
        lone = client.post("/v1/completions", content=b'{"prompt": "a \\ud800 b", "max_tokens": 1}')
        assert is_error_object(lone, 400) and lone.headers.get("connection") != "close"
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


def test_a_large_body_is_parsed_and_tokenized_off_the_event_loop(server):
    """A 3.6 MB prompt takes seconds to tokenize; /health answers meanwhile."""
    body = json.dumps({"prompt": "hello world " * 300_000, "max_tokens": 1}).encode()
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            httpx.get(f"{server.base}/health", timeout=60)
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    started = time.monotonic()
    response = post(server, "/v1/completions", body)
    took = time.monotonic() - started
    done.set()
    thread.join()
    assert is_error_object(response, 400) and "is longer than the model's context length" in response.text
    assert len(latencies) >= 3, f"the prompt took {took:.1f} s"
    assert max(latencies) < max(1.0, took / 3), f"/health took {max(latencies):.2f} s during a {took:.1f} s request"


def test_logprobs_with_a_grammar_are_the_models_and_finite(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a JSON object."}], "temperature": 0,
            "max_tokens": 12, "logprobs": True, "top_logprobs": 5, "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}
    response = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content and all(math.isfinite(t["logprob"]) and len(t["top_logprobs"]) == 5 for t in content)
    assert all(math.isfinite(top["logprob"]) for t in content for top in t["top_logprobs"])
    # Before the mask: the model's favourite comes first, whether or not the grammar allowed it.
    assert all(t["top_logprobs"][0]["logprob"] >= t["logprob"] - 1e-6 for t in content)
    generate = post(server, "/generate", json.dumps({"text": "x", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "regex": "[0-9]+"}, "return_logprob": True,
        "top_logprobs_num": 3}).encode())
    assert generate.status_code == 200 and all(math.isfinite(lp) for lp, _, _ in
                                               generate.json()["meta_info"]["output_token_logprobs"])


def test_the_openapi_document_describes_every_route(server):
    document = httpx.get(f"{server.base}/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health"} <= set(document["paths"])
    completion = document["paths"]["/v1/completions"]["post"]
    assert completion["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert "CompletionRequest" in document["components"]["schemas"] and completion["security"] == [{"bearer": []}]


# ---- the storm --------------------------------------------------------------------------------------


def run_storm(server: Server, requests: int, concurrency: int) -> dict:
    result = subprocess.run([sys.executable, str(STORM), "--base-url", server.base, "--api-key", API_KEY,
                             "--requests", str(requests), "--concurrency", str(concurrency)],
                            capture_output=True, text=True, timeout=1800)
    server_log = "".join(server.output[-60:])
    assert result.stdout, result.stderr[-3000:] + "\nserver:\n" + server_log
    summary = json.loads(result.stdout)
    assert not broke(summary), json.dumps(summary, indent=1)[:6000] + "\nserver:\n" + server_log
    assert result.returncode == 0
    return summary


def test_a_storm_of_mixed_traffic_breaks_nothing(server):
    summary = run_storm(server, requests=400, concurrency=32)
    assert sum(summary["statuses"].values()) >= 400 * 0.95   # every request answered (disconnects aside)
    assert summary["kv_idle"] == summary["kv_after"] == 0


@pytest.mark.soak
def test_a_long_soak_breaks_nothing(server):
    run_storm(server, requests=int(os.environ.get("SRV_SOAK_REQUESTS", "5000")), concurrency=64)


# ---- the scheduler: failures stay with their request, admission is never starved -----------------


def bare_scheduler(model_dir: Path, **flags):
    manager, registry = load_plugins()
    parser = build_launch_parser(manager, registry)
    argv = options_to_argv({"model_path": str(model_dir), "dtype": "float32", **flags}, parser, "test flags")
    return build_scheduler(parser.parse_args(argv), registry)[1]


def run_until(scheduler, done, limit: int = 2000) -> list[str]:
    """Step until `done()`; the rids in the order they finished."""
    finished = []
    for _ in range(limit):
        if done():
            return finished
        finished += [r.rid for r in scheduler.step() if r.finished]
    raise AssertionError("the scheduler did not get there")


def greedy(new_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, **extra)


def admission_order(model_dir: Path) -> tuple[list[str], Req]:
    """A long request runs; a big one that fits only once it ends arrives, then a small one.
    The order they finish in, and the big request."""
    scheduler = bare_scheduler(model_dir, max_total_tokens=256)
    running = Req("running", list(range(3, 23)), greedy(200))
    scheduler.add(running)
    run_until(scheduler, lambda: len(running.output_ids) >= 2)
    big, small = Req("big", list(range(3, 103)), greedy(100)), Req("small", list(range(5, 15)), greedy(4))
    scheduler.add(big)
    scheduler.add(small)
    order = run_until(scheduler, lambda: not scheduler.has_work)
    assert big.finish_reason.value == "length" and len(big.output_ids) == 100
    assert scheduler.flush_cache() and scheduler.kv_tokens_in_use() == 0
    return order, big


def test_a_request_that_does_not_fit_yet_lets_the_others_start(tiny_models, monkeypatch):
    order, _ = admission_order(tiny_models["llama"])
    assert order == ["small", "running", "big"], "the small request waited behind the big one"
    # Passed over for longer than the bound, the big request holds the others back until it fits.
    monkeypatch.setattr("srv.engine.scheduler.MAX_SKIP_S", 0.0)
    order, _ = admission_order(tiny_models["llama"])
    assert order == ["running", "small", "big"]


def test_the_tokenizer_loads_at_the_first_pause_not_beside_the_first_requests(tiny_models, monkeypatch):
    """The scheduler process's tokenizer (stop strings, grammars) loads in the background once
    the steps pause, or at its deadline under steady traffic."""
    monkeypatch.setattr("srv.engine.scheduler.PAUSE_S", 0.3)
    scheduler = bare_scheduler(tiny_models["llama"])
    scheduler.set_tokenizer_loader(lambda: "the tokenizer")
    scheduler.load_tokenizer_when_idle()
    first = Req("first", list(range(3, 13)), greedy(4))
    scheduler.add(first)
    run_until(scheduler, lambda: first.finished)
    scheduler.step()   # idle, for less than PAUSE_S
    assert scheduler._tokenizer is None, "started beside the first request"
    time.sleep(0.35)
    scheduler.step()
    assert scheduler._tokenizer.result(timeout=10) == "the tokenizer"

    monkeypatch.setattr("srv.engine.scheduler.TOKENIZER_LATEST_S", 0.0)
    busy = bare_scheduler(tiny_models["llama"])
    busy.set_tokenizer_loader(lambda: "the tokenizer")
    busy.load_tokenizer_when_idle()
    busy.add(Req("steady", list(range(3, 13)), greedy(4)))
    busy.step()
    assert busy._tokenizer.result(timeout=10) == "the tokenizer", "the deadline passed during traffic"


def test_a_request_waiting_for_the_tokenizer_holds_up_no_other(tiny_models):
    """A request with stop strings, added while the scheduler's tokenizer still loads, waits
    apart: the steps go on for the others, and it runs once the tokenizer is there (or is
    aborted while it waits)."""
    from transformers import AutoTokenizer

    scheduler = bare_scheduler(tiny_models["llama"])
    loaded = threading.Event()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    scheduler.set_tokenizer_loader(lambda: loaded.wait(30) and tokenizer)
    running = Req("running", list(range(3, 13)), greedy(6))
    scheduler.add(running)
    scheduler.step()
    stopping = Req("stopping", list(range(3, 13)), greedy(4, stop=["never printed"]))
    aborted = Req("aborted", list(range(3, 13)), greedy(4, stop=["never printed"]))
    scheduler.add(stopping)
    scheduler.add(aborted)
    assert not stopping.output_ids and stopping not in scheduler.waiting
    assert scheduler.queued == [stopping, aborted]   # what /get_load and the status count as waiting
    run_until(scheduler, lambda: running.finished)   # the loader still waits: no step blocked
    assert scheduler.abort("aborted") is aborted and aborted.finish_reason.value == "abort"
    loaded.set()
    scheduler._tokenizer.result(timeout=30)
    run_until(scheduler, lambda: stopping.finished)
    assert len(stopping.output_ids) == 4 and stopping.stop_matcher is not None
    assert "aborted" not in [r.rid for r in scheduler.waiting + scheduler.running]


def test_a_request_that_breaks_the_forward_fails_alone(tiny_models):
    scheduler = bare_scheduler(tiny_models["llama"])
    forward = scheduler.runner.forward
    poison = 49151

    def fragile(input_ids: torch.Tensor, *args, **kwargs):
        if (input_ids == poison).any():
            raise IndexError("index out of range in self")
        return forward(input_ids, *args, **kwargs)

    prompts = [list(range(3, 13)), [7, 8, poison, 9], list(range(20, 31))]
    alone = []
    for i, ids in enumerate([prompts[0], prompts[2]]):
        req = Req(f"alone-{i}", ids, greedy(6))
        scheduler.add(req)
        run_until(scheduler, lambda: req.finished)
        alone.append(req.output_ids)
    scheduler.runner.forward = fragile
    loop = SchedulerLoop(scheduler)
    reqs = [Req(f"r{i}", ids, greedy(6)) for i, ids in enumerate(prompts)]
    for req in reqs:
        scheduler.add(req)
    outputs = []
    while scheduler.has_work:
        outputs += loop.step()
    errors = {out.rid: out.error for out in outputs if out.error}
    assert list(errors) == ["r1"] and "IndexError" in errors["r1"]
    assert [reqs[0].output_ids, reqs[2].output_ids] == alone
    assert scheduler.flush_cache() and scheduler.kv_tokens_in_use() == 0


def test_a_step_that_raises_fails_what_it_held_and_the_loop_goes_on(tiny_models, monkeypatch):
    scheduler = bare_scheduler(tiny_models["llama"])
    loop = SchedulerLoop(scheduler)
    first = Req("first", list(range(3, 13)), greedy(4))
    scheduler.add(first)
    broken = {"once": True}
    process = scheduler._process

    def process_once(result):
        if broken.pop("once", False):
            raise RuntimeError("a sampler plugin's bug")
        return process(result)

    monkeypatch.setattr(scheduler, "_process", process_once)
    outputs = loop.step()
    assert [(o.rid, "RuntimeError" in (o.error or "")) for o in outputs] == [("first", True)]
    second = Req("second", list(range(3, 13)), greedy(4))
    scheduler.add(second)
    while scheduler.has_work:
        outputs += loop.step()
    assert second.finish_reason.value == "length" and len(second.output_ids) == 4
    assert scheduler.flush_cache() and scheduler.kv_tokens_in_use() == 0


def test_the_scheduler_and_the_front_end_cut_at_the_same_stop_string(tiny_models):
    """A stop string in the first min_new_tokens tokens counts for neither side: the text is not
    cut there while the tokens go on (the front end and the scheduler used to disagree)."""
    with srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32") as engine:
        plain = engine.generate(input_ids=list(range(3, 20)), sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                              "ignore_eos": True})
        tokenizer = engine.tokenizer
        early = tokenizer.decode(plain["output_ids"][1:2]).strip()
        assert early, "the test needs a token with text"
        result = engine.generate(input_ids=list(range(3, 20)), sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [early], "min_new_tokens": 5})
        assert result["output_ids"] == plain["output_ids"][:len(result["output_ids"])]
        assert len(result["output_ids"]) > 5 or result["meta_info"]["finish_reason"]["matched"] == early
        head = tokenizer.decode(result["output_ids"][:5])
        assert result["text"].startswith(head), (result["text"], head)
        full = tokenizer.decode(result["output_ids"])
        reason = result["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            assert reason["matched"] == early and full.startswith(result["text"]) and early in full[len(head):]
        else:
            assert result["text"] == full


def test_a_flush_while_a_request_runs_is_refused_and_the_request_ends_well(tiny_models):
    scheduler = bare_scheduler(tiny_models["llama"], page_size=16)
    req = Req("running", list(range(3, 13)), greedy(4))   # shorter than a page: nothing of it is cached yet
    scheduler.add(req)
    scheduler.step()
    assert not scheduler.flush_cache()
    run_until(scheduler, lambda: req.finished)
    assert len(req.output_ids) == 4 and scheduler.flush_cache() and scheduler.kv_tokens_in_use() == 0


# ---- schemathesis against the served OpenAPI document ---------------------------------------------


def run_schemathesis(server: Server, phases: str, max_examples: int, folder: Path) -> None:
    """No 5xx, and every status, content type, header and body as the document says. A tiny model
    with a tiny context keeps each generated request cheap: the routes' checks are under test."""
    st = Path(sys.executable).with_name("st")
    # Operations that change the whole server (a pause stalls every later request, a profile or a
    # logging change outlives the call): their own tests cover them.
    stateful = "^/(pause_generation|continue_generation|start_profile|stop_profile|configure_logging)$"
    result = subprocess.run([str(st), "run", f"{server.base}/openapi.json", "-H", f"Authorization: Bearer {API_KEY}",
                             "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                             "response_schema_conformance,response_headers_conformance",
                             "--exclude-path-regex", stateful,
                             "--phases", phases, "--max-examples", str(max_examples), "--seed", "1", "-w", "2",
                             "--request-timeout", "120"], capture_output=True, text=True, timeout=3600,
                            env={**os.environ, "NO_COLOR": "1"}, cwd=folder)   # its example database goes there
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "passed" in result.stdout and "failed" not in result.stdout.split("SUMMARY")[-1]


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    server = Server("--api-key", API_KEY, "--enable-metrics", "--model-path", str(tiny_models["llama"]),
                    "--context-length", "16")
    yield server
    server.stop()


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(tiny_server, tmp_path):
    run_schemathesis(tiny_server, "fuzzing", 60, tmp_path)


@pytest.mark.soak
def test_schemathesis_covers_every_boundary(tiny_server, tmp_path):
    run_schemathesis(tiny_server, "coverage,fuzzing", 200, tmp_path)


# ---- an exception past validation is an error object, never a dropped connection -----------------


def test_an_unexpected_exception_is_a_500_error_object_and_never_reaches_uvicorn():
    import asyncio

    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from srv.server.app import ErrorBoundary, event_stream

    async def boom(request):
        raise RuntimeError("a plugin route's bug")

    async def broken_stream(request):
        async def states():
            raise KeyError("mid-stream")
            yield  # an async generator

        return event_stream(states(), lambda state, text: [])

    app = Starlette(routes=[Route("/boom", boom), Route("/stream", broken_stream)], middleware=[Middleware(ErrorBoundary)])

    async def call() -> tuple[httpx.Response, httpx.Response]:
        # raise_app_exceptions: an exception that escaped the app would fail the test here.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://srv") as client:
            return await client.get("/boom"), await client.get("/stream")

    plain, stream = asyncio.run(call())
    assert is_error_object(plain, 500) and "RuntimeError: a plugin route's bug" in plain.json()["error"]["message"]
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert stream.status_code == 200 and events[-1]["error"]["code"] == 500 and "KeyError" in events[-1]["error"]["message"]


NAN_ATTENTION = """
import torch

from srv.sdk import hookimpl
from srv.sdk.attention import AttentionBackend


class NaNAttention(AttentionBackend):
    def attend(self, q, layer_id, batch):
        return torch.full_like(q, float("nan"))


@hookimpl
def srv_register_attention_backends(register):
    register("nan", NaNAttention, description="NaN everywhere (--crash-on-nan test)")
"""


def test_a_fault_the_scheduler_cannot_absorb_ends_the_server_at_once(fake_dists, monkeypatch):
    """--crash-on-nan: the scheduler process exits (not hangs on its ZMQ context at exit), the
    request gets an error, and the server exits non-zero."""
    fake_dists.add("srv-nan", {"nan": "nan_plugin"}, {"nan_plugin": NAN_ATTENTION})
    monkeypatch.setenv("PYTHONPATH", fake_dists.env["PYTHONPATH"])
    server = Server("--attention-backend", "nan", "--crash-on-nan", "true", "--skip-server-warmup")
    started = time.monotonic()
    response = httpx.post(f"{server.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert response.status_code >= 500 and "scheduler process died" in response.json()["error"]["message"]
    assert server.process.wait(timeout=30) != 0
    assert time.monotonic() - started < 30
    assert "NaN in the logits" in "".join(server.output)


def test_a_scheduler_that_dies_while_warming_up_is_not_served(fake_dists, monkeypatch):
    """The warm-up request kills the scheduler (--crash-on-nan): the server exits non-zero instead
    of listening with a dead scheduler behind it."""
    fake_dists.add("srv-nan", {"nan": "nan_plugin"}, {"nan_plugin": NAN_ATTENTION})
    monkeypatch.setenv("PYTHONPATH", fake_dists.env["PYTHONPATH"])
    launch = subprocess.run([sys.executable, "-m", "srv", "launch", "--port", str(free_port()), "--dtype", "float32",
                             "--attention-backend", "nan", "--crash-on-nan", "true"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    output = launch.stdout + launch.stderr
    assert launch.returncode != 0 and "exiting: the scheduler process died" in output, output[-3000:]
    assert "serving " not in output and "Uvicorn running" not in output

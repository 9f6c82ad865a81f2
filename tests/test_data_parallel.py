"""Data parallelism (`--data-parallel-size`): scheduler groups behind one server, a router that
spreads requests as each `--load-balance-method` promises, and replies merged over the groups."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from srv.engine.errors import InvalidRequest
from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.sdk.sampling import SamplingParams
from srv.server.data_parallel import DataParallelRouter
from test_server import Server


def router(method: str, groups: int = 2) -> tuple[DataParallelRouter, list[list]]:
    sent: list[list] = [[] for _ in range(groups)]
    return DataParallelRouter([box.append for box in sent], method), sent


def request(rid: str, prompt: int, new: int = 8, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=new), session_id=session)


def test_round_robin_takes_groups_in_turn():
    r, sent = router("round_robin", 3)
    for i in range(7):
        r.send(request(f"r{i}", 4))
    assert [[m.rid for m in box] for box in sent] == [["r0", "r3", "r6"], ["r1", "r4"], ["r2", "r5"]]
    assert r.assigned == [3, 2, 2]


def test_shortest_queue_counts_requests_in_flight_until_they_finish():
    r, sent = router("shortest_queue")
    for i in range(3):
        r.send(request(f"r{i}", 4))        # groups 0, 1, 0
    r.receive(0, RequestOutput("r0", [5], finish_reason="length"))
    r.receive(0, RequestOutput("r2", [5]))   # not finished: still in flight
    r.send(request("r3", 4))               # group 0 holds one, group 1 one: the lower index
    r.receive(1, RequestOutput("r1", [], error="bad"))
    r.send(request("r4", 4))               # group 1 is empty now
    assert [[m.rid for m in box] for box in sent] == [["r0", "r2", "r3"], ["r1", "r4"]]


def test_minimum_tokens_weighs_the_prompts_sent_before_any_load_is_reported():
    r, sent = router("minimum_tokens")
    r.send(request("long", 500))   # group 0: 500 tokens
    r.send(request("a", 10))       # group 1: 10
    r.send(request("b", 300))      # group 1: 310
    r.send(request("c", 150))      # group 1: 460 < 500
    r.send(request("d", 10))       # group 1: 470
    assert [[m.rid for m in box] for box in sent] == [["long"], ["a", "b", "c", "d"]]


def test_minimum_tokens_balances_by_the_load_each_group_reports():
    """Each group's answer to the load call replaces what the router counted for the requests
    sent before it (a prefix hit or a finished request lowers it); requests sent after the call
    are added on top until the next answer."""
    r, sent = router("minimum_tokens")
    r.send(request("a", 400))                  # group 0
    r.send(request("b", 300))                  # group 1
    r.watch_load()
    calls = [box[-1] for box in sent]
    assert all(isinstance(call, ControlRequest) and call.method == "load" and call.call_id < 0 for call in calls)
    r.watch_load()                             # no group answered: nothing asked twice
    assert [len(box) for box in sent] == [2, 2]
    r.send(request("c", 50))                   # group 1: 350 < 400
    # Group 0's request hit the prefix cache and finished: it reports 20 tokens; group 1 still
    # counts c on top of the 300 it reports.
    assert r.receive(0, ControlResult(calls[0].call_id, {"num_reqs": 0, "num_waiting_reqs": 0,
                                                         "num_tokens": 20})) is None
    assert r.receive(1, ControlResult(calls[1].call_id, {"num_reqs": 1, "num_waiting_reqs": 0,
                                                         "num_tokens": 300})) is None
    r.send(request("d", 200))                  # group 0: 20 < 350
    r.send(request("e", 100))                  # group 0: 220 < 350
    r.send(request("f", 100))                  # group 0: 320 < 350
    r.send(request("g", 10))                   # group 1: 350 < 420
    assert [[m.rid for m in box if isinstance(m, GenerateRequest)] for box in sent] == [["a", "d", "e", "f"],
                                                                                         ["b", "c", "g"]]
    r.watch_load()                             # both answered: both asked again
    assert [len(box) for box in sent] == [6, 5]
    # A refused call leaves the count as it was, and the group is asked again next time.
    r.receive(0, ControlResult(sent[0][-1].call_id, None, error="stopping"))
    r.watch_load()
    assert isinstance(sent[0][-1], ControlRequest) and len(sent[0]) == 7


def test_only_minimum_tokens_watches_the_load():
    assert [router(method)[0].watches_load for method in ("round_robin", "shortest_queue", "minimum_tokens")] \
        == [False, False, True]


def test_sessions_stay_on_their_group_and_aborts_reach_the_owner():
    r, sent = router("round_robin")
    r.send(request("s1", 4, session="chat"))
    r.send(request("x", 4))
    r.send(request("s2", 4, session="chat"))
    r.send(AbortRequest("x"))
    r.send(AbortRequest("unknown"))
    assert [type(m).__name__ + ":" + m.rid for m in sent[0]] == ["GenerateRequest:s1", "GenerateRequest:s2",
                                                                   "AbortRequest:unknown"]
    assert [type(m).__name__ + ":" + m.rid for m in sent[1]] == ["GenerateRequest:x", "AbortRequest:x",
                                                                   "AbortRequest:unknown"]


def test_a_routed_rank_picks_the_group_unless_its_session_is_held_by_another():
    r, sent = router("round_robin", 3)
    named = GenerateRequest("named", [3, 4], SamplingParams(max_new_tokens=8), dp_rank=2)
    r.send(named)
    r.send(request("next", 4))   # the router's own turn is not used up by a routed request
    r.send(GenerateRequest("turn", [3], SamplingParams(), session_id="chat", dp_rank=1))
    r.send(request("turn2", 4, session="chat"))   # the session stays where its first turn went
    assert [[m.rid for m in box] for box in sent] == [["next"], ["turn", "turn2"], ["named"]]
    with pytest.raises(InvalidRequest, match="session 'chat' is held by data-parallel rank 1, not 0"):
        r.send(GenerateRequest("elsewhere", [3], SamplingParams(), session_id="chat", dp_rank=0))
    assert r.assigned == [1, 2, 1]


def test_control_calls_reach_every_group_and_their_replies_merge():
    r, sent = router("round_robin")
    r.send(ControlRequest(7, "status"))
    r.send(ControlRequest(8, "flush_cache"))
    r.send(ControlRequest(9, "update_weights_from_disk"))
    assert all(len(box) == 3 for box in sent)
    assert r.receive(0, ControlResult(7, {"pid": 11, "running_requests": 2, "spec_accept_length": 1.5})) is None
    merged = r.receive(1, ControlResult(7, {"pid": 12, "running_requests": 3, "spec_accept_length": 2.0}))
    assert merged.call_id == 7 and merged.value["pid"] == 11 and merged.value["running_requests"] == 5
    assert merged.value["spec_accept_length"] == 1.5 and len(merged.value["data_parallel_groups"]) == 2
    r.receive(1, ControlResult(8, False))
    assert r.receive(0, ControlResult(8, True)).value is False
    r.receive(0, ControlResult(9, None, error="busy"))
    assert r.receive(1, ControlResult(9, True)).error == "busy"


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="round_robin, shortest_queue, minimum_tokens"):
        DataParallelRouter([print], "follow_bootstrap_room")


def test_dp2_server_gives_each_request_its_output_alone_and_spreads_them_round_robin():
    server = Server("--dp-size", "2", "--skip-server-warmup", "--max-total-tokens", "4096",
                    "--enable-metrics", "--enable-metrics-for-all-schedulers")
    try:
        prompts = ["The capital of France is", "One, two, three, four,", "def add(a, b):", "Water boils at"]

        def complete(prompt: str) -> str:
            reply = httpx.post(f"{server.base}/v1/completions", timeout=120,
                               json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200
            return reply.json()["choices"][0]["text"]

        alone = [complete(p) for p in prompts]           # requests 0..3: groups 0, 1, 0, 1
        together: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, complete(prompts[i])))
                   for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [together[i] for i in range(len(prompts))] == alone
        status = server.scheduler_status()
        groups = status["data_parallel_groups"]
        assert len(groups) == 2 and groups[0]["pid"] != groups[1]["pid"]
        # Round robin: each group computed four of the eight requests (12 tokens each), two alone.
        assert [g["generated_tokens"] for g in groups] == [4 * 12, 4 * 12]
        assert groups[0]["prompt_tokens"] > 0 and groups[1]["prompt_tokens"] > 0
        assert status["prompt_tokens"] == sum(g["prompt_tokens"] for g in groups)
        assert status["generated_tokens"] == sum(g["generated_tokens"] for g in groups)
        # Routed by the caller: the header (SGLang's and vLLM's) and /generate's field.
        for rank in ("1", "1", "0"):
            reply = httpx.post(f"{server.base}/v1/completions", headers={"X-Data-Parallel-Rank": rank}, timeout=120,
                               json={"prompt": "Hi", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        reply = httpx.post(f"{server.base}/generate", timeout=120, json={
            "text": "Hi", "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}})
        assert reply.status_code == 200, reply.text
        reply = httpx.post(f"{server.base}/generate", json={"text": "Hi", "routed_dp_rank": 2}, timeout=120)
        assert reply.status_code == 400 and "ranks 0 to 1" in reply.json()["error"]["message"]
        routed = server.scheduler_status()["data_parallel_groups"]
        assert [g["generated_tokens"] for g in routed] == [5 * 12, 7 * 12]
        # --enable-metrics-for-all-schedulers: each group's gauges, labelled with its rank.
        metrics = httpx.get(f"{server.base}/metrics", timeout=30).text
        for rank in ("0", "1"):
            assert re.search(r'sglang:num_used_tokens\{[^}]*dp_rank="%s"' % rank, metrics), metrics[:2000]
    finally:
        assert server.stop() == 0


def test_minimum_tokens_server_balances_by_the_load_the_groups_report(tiny_models):
    """Every 50 ms each group reports its load. A finished request leaves only evictable prefix
    cache behind, which is no load: the next request may go to the same group. Prompts queued
    behind a paused server are load: the short requests after a long one go to the other group
    (round robin would alternate in both cases)."""
    server = Server("--model-path", str(tiny_models["llama"]), "--dp-size", "2", "--skip-server-warmup",
                    "--load-balance-method", "minimum_tokens", "--load-watch-interval", "0.05")

    def generate(prompt: list[int]) -> None:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        assert httpx.post(f"{server.base}/generate", json=body, timeout=120).status_code == 200

    def load() -> list[dict]:
        return httpx.get(f"{server.base}/get_load", timeout=30).json()

    try:
        generate(list(range(100, 400)))   # group 0 (both idle)
        time.sleep(0.3)                    # group 0 has answered a load call since
        generate([7] * 8)                  # group 0 again: its cached prompt is not load
        groups = server.scheduler_status()["data_parallel_groups"]
        assert [g["generated_tokens"] for g in groups] == [8, 0]

        assert httpx.post(f"{server.base}/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
        waiting = [threading.Thread(target=generate, args=(list(range(500, 800)),))]   # group 0 (both at 0)
        waiting[0].start()
        deadline = time.monotonic() + 30
        while load()[0]["num_waiting_reqs"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        for i in range(3):
            waiting.append(threading.Thread(target=generate, args=([9 + i] * 8,)))
            waiting[-1].start()
        while [entry["num_waiting_reqs"] for entry in load()] != [1, 3]:
            assert time.monotonic() < deadline, load()
            time.sleep(0.05)
        assert [entry["dp_rank"] for entry in load()] == [0, 1] and load()[0]["num_tokens"] >= 300
        assert httpx.post(f"{server.base}/continue_generation", timeout=30).status_code == 200
        for thread in waiting:
            thread.join(120)
        groups = server.scheduler_status()["data_parallel_groups"]
        assert [g["generated_tokens"] for g in groups] == [12, 12]
    finally:
        assert server.stop() == 0


def generate_at_once(server: Server, prompts: list[list[int]], params: dict) -> dict[int, list[int]]:
    """Each prompt's output ids, the requests sent together from threads of their own."""
    outputs: dict[int, list[int]] = {}

    def generate(i: int) -> None:
        reply = httpx.post(f"{server.base}/generate", timeout=120,
                           json={"input_ids": prompts[i], "sampling_params": params})
        assert reply.status_code == 200, reply.text
        outputs[i] = reply.json()["output_ids"]

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return outputs


@pytest.mark.parametrize("kind, flags", [("llama", ()), ("qwen3", ()), ("qwen3", ("--enable-dp-lm-head",)),
                                         ("qwen3_moe", ()), ("qwen2_moe", ("--moe-dense-tp-size", "1"))],
                         ids=["llama-vocab-split-head", "qwen3-tied-split-head", "qwen3-tied-dp-lm-head", "qwen3-moe",
                              "qwen2-moe-dense-whole"])
def test_dp_attention_ranks_step_together_and_give_hf_greedy_tokens(tiny_models, tiny_moe_models, kind, flags):
    """--enable-dp-attention: two groups, each one scheduler process with its own KV cache and
    attention whole, the feed-forward blocks split across both and run on both ranks' rows. A
    16-token prefill chunk makes the ranks' passes differ in number: the rank with fewer runs
    IDLE passes beside the other's."""
    from test_engine import NEW_TOKENS, hf_greedy, random_prompts

    model = {**tiny_models, **tiny_moe_models}[kind]
    server = Server("--model-path", str(model), "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", *flags,
                    "--skip-server-warmup", "--chunked-prefill-size", "16", "--max-total-tokens", "4096")
    try:
        prompts = random_prompts(6)
        outputs = generate_at_once(server, prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0})
        for i, ids in enumerate(prompts):
            assert outputs[i] == hf_greedy(str(model), tuple(ids)), f"prompt {i}"
        groups = server.scheduler_status()["data_parallel_groups"]
        assert [g["generated_tokens"] for g in groups] == [3 * NEW_TOKENS, 3 * NEW_TOKENS]
        assert httpx.post(f"{server.base}/flush_cache", timeout=30).status_code == 200
        assert server.scheduler_status()["kv_tokens_in_use"] == 0
    finally:
        assert server.stop() == 0
    assert "data-parallel attention rank 1 of 2" in "".join(server.output)


@pytest.mark.parametrize("flags, message", [
    (["--enable-dp-lm-head"], "--enable-dp-lm-head needs --enable-dp-attention"),
    (["--enable-dp-attention"], "--enable-dp-attention needs --data-parallel-size > 1"),
    (["--enable-dp-attention", "--dp-size", "2", "--tp-size", "4"], "the sizes must be equal"),
    (["--dp-size", "2", "--load-watch-interval", "0"], "--load-watch-interval 0.0: the seconds between load calls"),
])
def test_data_parallel_layouts_srv_cannot_run_are_refused(flags, message, capsys):
    from srv.args.parser import parse_launch_args
    from srv.plugin_manager import load_plugins

    with pytest.raises(SystemExit):
        parse_launch_args(flags, *load_plugins())
    assert message in capsys.readouterr().err


def test_a_dead_dp_attention_rank_ends_the_server(tiny_models):
    """The other rank would wait in its next collective: the server sees a scheduler die, exits
    non-zero, and every process it started goes."""
    import os
    import signal

    from test_server import assert_gone, descendants

    server = Server("--model-path", str(tiny_models["llama"]), "--tp-size", "2", "--dp-size", "2",
                    "--enable-dp-attention", "--skip-server-warmup", "--max-total-tokens", "4096")
    try:
        reply = httpx.post(f"{server.base}/generate", timeout=120,
                           json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
        assert reply.status_code == 200
        children = descendants(server.process.pid)
        os.kill(server.scheduler_status()["data_parallel_groups"][1]["pid"], signal.SIGKILL)
        assert server.process.wait(timeout=60) != 0
        assert_gone(children)
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.parametrize("algorithm, flags", [("NGRAM", ()), ("EAGLE3", ("--enable-dp-lm-head",))],
                         ids=["ngram", "eagle3-dp-lm-head"])
def test_dp_attention_ranks_each_draft_for_their_own_requests(srv_tiny_model_dir, tmp_path, algorithm, flags):
    """Each attention rank proposes and verifies its own requests' drafts; its verify passes pair
    up with the other rank's passes as any pass does. EAGLE3 reads the head between passes, so it
    needs the head whole on each rank (without it the launch fails, naming the flag)."""
    from srv.sdk.testing import hf_greedy, tiny_llama
    from srv.sdk.testing.speculative import repeating_prompts
    from test_speculative import write_eagle_head

    head = ("--speculative-draft-model-path", str(write_eagle_head(tmp_path / "eagle3", eagle3=True))) \
        if algorithm == "EAGLE3" else ()
    launch = ("--model-path", str(srv_tiny_model_dir), "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
              "--skip-server-warmup", "--speculative-algorithm", algorithm, *head)
    if flags:
        with pytest.raises(RuntimeError, match="needs --enable-dp-lm-head"):
            Server(*launch)
    server = Server(*launch, *flags)
    try:
        prompts = repeating_prompts(seed=2)
        outputs = generate_at_once(server, prompts, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
        for i, prompt in enumerate(prompts):
            assert outputs[i] == hf_greedy(tiny_llama(), prompt, 16), f"prompt {i}"
        groups = server.scheduler_status()["data_parallel_groups"]
        assert all(g["spec_draft_tokens"] > 0 for g in groups), groups
    finally:
        assert server.stop() == 0

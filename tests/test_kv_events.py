"""--kv-events-config: the prefix cache's changes published as vLLM's and SGLang's KV events
(msgpack batches on a ZMQ PUB socket, a replay socket for missed ones), read here as their
subscribers read them."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

import srv
from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from srv.plugins.cache.kv_events import ZmqPublisher, rank_endpoint
from srv.sdk.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hashes
from srv.sdk.testing import KVEventPublisherKit
from test_engine import random_prompts
from test_server import free_port

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def receive(socket: zmq.Socket, until: type, timeout: float = 30.0) -> list[tuple[int, KVEventBatch]]:
    """Batches (with their sequence numbers) until one holds an event of type `until`."""
    batches: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.poll(100):
            topic, sequence, payload = socket.recv_multipart()
            assert topic == b"kv"
            batches.append((int.from_bytes(sequence, "big"), DECODER.decode(payload)))
            if any(isinstance(e, until) for e in batches[-1][1].events):
                return batches
    raise AssertionError(f"no {until.__name__} event within {timeout} s: {batches}")


def test_events_follow_the_prefix_cache_and_missed_batches_replay(tiny_models):
    port, replay_port = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    with srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32", page_size=4,
                    kv_events_config=json.dumps(config)) as engine:
        subscriber.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)   # a PUB socket drops what it sends before a subscriber has joined
        prompt = random_prompts(5)[4]   # 41 tokens: 10 pages
        result = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
        batches = receive(subscriber, BlockStored)
        # The request's tokens, cached page by page as it ends: every block chained on the one before.
        time.sleep(0.3)
        while subscriber.poll(100):
            topic, sequence, payload = subscriber.recv_multipart()
            batches.append((int.from_bytes(sequence, "big"), DECODER.decode(payload)))
        stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
        assert all(e.block_size == 4 and e.lora_id is None for e in stored)
        tokens = [t for e in stored for t in e.token_ids]
        hashes = [h for e in stored for h in e.block_hashes]
        assert tokens == (prompt + result["output_ids"])[:len(tokens)] and len(tokens) >= 40
        assert hashes == block_hashes(None, tokens, 4) and all(0 <= h < 2**63 for h in hashes)
        assert stored[0].parent_block_hash is None
        assert all(b.data_parallel_rank == 0 for _, b in batches)

        assert engine.flush_cache()
        cleared = receive(subscriber, AllBlocksCleared)
        removed = [h for _, b in cleared for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert sorted(removed) == sorted(hashes)
        sequences = [s for s, _ in batches + cleared]
        assert sequences == list(range(len(sequences)))

        # A subscriber that missed batches asks the replay socket for them from a sequence number on.
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert replay.poll(10_000)
            _, sequence, payload = replay.recv_multipart()
            if int.from_bytes(sequence, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(sequence, "big"), DECODER.decode(payload)))
        assert [s for s, _ in replayed] == sequences[1:]
        assert [b.events for _, b in replayed] == [b.events for _, b in (batches + cleared)[1:]]
    context.destroy(linger=0)


def test_each_data_parallel_rank_publishes_on_its_own_endpoint():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_a_key_the_publisher_does_not_take_is_refused():
    with pytest.raises(ValueError, match="not endpont"):
        ZmqPublisher({"publisher": "zmq", "endpont": "tcp://*:1"})


@pytest.mark.parametrize("flags, message", [
    (["--kv-events-config", "{"], "--kv-events-config is not valid JSON"),
    (["--kv-events-config", "[1]"], "must be a JSON object"),
    (["--kv-events-config", '{"publisher": "nats"}'], "unknown kv_events_publisher backend 'nats'"),
    (["--kv-events-config", '{"publisher": "zmq"}', "--disable-radix-cache"], "needs the prefix cache"),
])
def test_configs_srv_cannot_honour_are_refused_at_launch(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(flags, *load_plugins())
    assert message in capsys.readouterr().err


class TestZmqPublisherKit(KVEventPublisherKit):
    backend_name = "zmq"

    def make_config(self):
        return {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"}


class TestNullPublisherKit(KVEventPublisherKit):
    backend_name = "null"


def test_the_hierarchical_cache_reports_what_enters_and_leaves_its_pool(tiny_models):
    """Prompts pushed out of a small pool to host memory and loaded back: every block removed was
    stored before, every block stored again was removed before, and the stored blocks are the
    prompts' own chained hashes."""
    from srv.sdk.kv_events import KVEventPublisher
    from srv.sdk.testing import registered_temporarily
    from test_hicache import SHORT, hicache, prompts

    batches: list[KVEventBatch] = []

    class Collect(KVEventPublisher):
        def publish(self, batch):
            batches.append(batch)

    batch = prompts(4, 60, seed=30)
    with registered_temporarily("kv_events_publisher", "collect", Collect):
        with srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32", max_total_tokens=150, page_size=4,
                        kv_events_config=json.dumps({"publisher": "collect"}), **hicache()) as engine:
            for _ in range(2):
                for prompt in batch:
                    engine.generate(input_ids=prompt, sampling_params=SHORT)
            assert engine.status()["hicache"]["host_hit_tokens"] > 0
            assert engine.flush_cache()
            deadline = time.monotonic() + 10
            while not any(isinstance(e, AllBlocksCleared) for b in batches for e in b.events):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    live: set[int] = set()
    removed: set[int] = set()
    back = 0   # blocks stored after their removal: loaded back from the host tier
    for event in (e for b in batches for e in b.events):
        if isinstance(event, BlockStored):
            assert not live & set(event.block_hashes), "a block stored twice without its removal"
            back += len(removed & set(event.block_hashes))
            live |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= live, "a block removed that was not stored"
            live -= set(event.block_hashes)
            removed |= set(event.block_hashes)
        else:
            live.clear()
    stored = {h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert {h for prompt in batch for h in block_hashes(None, prompt, 4)} <= stored
    assert back > 0 and not live

"""Publishers of KV cache events (`--kv-events-config`, srv.sdk.kv_events).

`zmq` publishes as vLLM and SGLang do, so their subscribers read it: a PUB socket bound at
"endpoint" sends each batch as three frames (the "topic", a sequence number as 8 big-endian
bytes, the msgpack batch); with a "replay_endpoint", a ROUTER socket answers a request of
[sequence number] with every buffered batch from that one on (the last "buffer_steps"), each as
[sequence, batch], and ends with sequence -1 and an empty frame. Each data-parallel rank
publishes on its own endpoint: a TCP port plus the rank, or an IPC path with "_dp<rank>" added.
Sending runs on a thread of its own; a batch that finds "max_queue_size" batches waiting is dropped.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

from srv.sdk.kv_events import KVEventBatch, KVEventPublisher

logger = logging.getLogger("srv.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` publishes on."""
    if rank == 0:
        return endpoint
    tcp = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if tcp:
        return f"{tcp.group(1)}{int(tcp.group(2)) + rank}"
    return f"{endpoint}_dp{rank}"


class NullPublisher(KVEventPublisher):
    def publish(self, batch: KVEventBatch) -> None:
        pass


class ZmqPublisher(KVEventPublisher):
    DEFAULTS = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": None, "buffer_steps": 10_000,
                "hwm": 100_000, "max_queue_size": 100_000, "topic": ""}

    def __init__(self, config: dict[str, Any], data_parallel_rank: int = 0) -> None:
        super().__init__(config, data_parallel_rank)
        unknown = sorted(set(config) - set(self.DEFAULTS))
        if unknown:
            raise ValueError(f"--kv-events-config: the zmq publisher takes {', '.join(sorted(self.DEFAULTS))}; "
                             f"not {', '.join(unknown)}")
        settings = {**self.DEFAULTS, **config}
        self.topic = str(settings["topic"]).encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=int(settings["buffer_steps"]))
        self.queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=int(settings["max_queue_size"]))
        self.dropped = 0
        self.context = zmq.Context()
        # Bound here, so that a taken port fails the launch; used only by the sending thread after.
        self.socket = self.context.socket(zmq.PUB)
        self.socket.set_hwm(int(settings["hwm"]))
        self.endpoint = rank_endpoint(settings["endpoint"], data_parallel_rank)
        self.socket.bind(self.endpoint)
        self.replay = None
        if settings["replay_endpoint"]:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.bind(rank_endpoint(settings["replay_endpoint"], data_parallel_rank))
        logger.info("KV events: publishing on %s%s", self.endpoint,
                    f", replaying on {rank_endpoint(settings['replay_endpoint'], data_parallel_rank)}"
                    if self.replay is not None else "")
        self.thread = threading.Thread(target=self._send, name="srv-kv-events", daemon=True)
        self.thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the queue is full)", self.dropped)

    def _send(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sequence = 0
        while True:
            try:
                batch = self.queue.get(timeout=0.05)
            except queue.Empty:
                batch = False
            if batch is None:
                break
            if batch is not False:
                payload = encoder.encode(batch)
                self.socket.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
                self.buffer.append((sequence, payload))
                sequence += 1
            while self.replay is not None and self.replay.poll(0):
                self._answer_replay()
        for socket in (self.socket, self.replay):
            if socket is not None:
                socket.close(linger=500)
        self.context.term()

    def _answer_replay(self) -> None:
        client, _, start = self.replay.recv_multipart()
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self.buffer):
            if sequence >= first:
                self.replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                self.queue.put(None, timeout=5)
            except queue.Full:   # the thread is stuck: it is a daemon, and ends with the process
                return
            self.thread.join(5)

"""Runs a Scheduler against incoming messages and turns its steps into `RequestOutput`s.

Transport-free: `srv.Engine` drives it from a thread, the server's scheduler process from ZMQ.
A request that makes the scheduler raise ends with an error and the loop goes on; only a fault
that leaves the process unusable (--crash-on-nan's, one from inside the failure handling)
propagates, and ends the process with its crash dump.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import Any, Callable

from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.engine.expert_distribution import ExpertDistributionRecorder, balancedness
from srv.engine.expert_location import placement_span
from srv.engine.profiler import StepProfiler
from srv.sdk.kv_events import KVEventBatch, KVEventPublisher
from srv.sdk.moe import FusedMoE, config_num_experts, rank_utilization
from srv.engine.request import Req
from srv.engine.scheduler import Scheduler

Message = GenerateRequest | AbortRequest | ControlRequest

logger = logging.getLogger("srv.scheduler")
THROUGHPUT_WINDOW_S = 5.0
IDLE_SLEEP_S = 1.0   # --sleep-on-idle: the longest idle wait for a message
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")


class WhenIdle:
    """A control method's answer to be computed once no request runs (`action()`)."""

    def __init__(self, action: Callable[[], Any]) -> None:
        self.action = action


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._sent: dict[str, int] = {}   # output tokens already reported, per request
        self._sent_hidden: dict[str, int] = {}   # hidden states already reported, per request
        self._generated: collections.deque[tuple[float, int]] = collections.deque()
        self._logged_decode_steps = 0
        self.paused = False              # /pause_generation: no steps until /continue_generation
        self.profiler = StepProfiler()
        self.experts = self._expert_recorder()
        # --eplb-rebalance-layers-per-chunk: the layers of a new placement still to place, a
        # chunk after each step.
        self._placing: list[tuple[int, list[int]]] = []
        args = scheduler.args
        self.recv_interval = args.scheduler_recv_interval
        self.sleep_on_idle = bool(args.sleep_on_idle)
        self.continuous_decode_steps = args.num_continuous_decode_steps
        self._steps_since_receive = 0
        self._control_outputs: list[RequestOutput] = []   # what a control call ended (aborted requests)
        # A control call that waits for the running requests to end: (call id, what to do then).
        self._deferred: tuple[int, Callable[[], Any]] | None = None
        self.released: set[str] = set()   # what /release_memory_occupation dropped ("weights", "kv_cache")
        # --enable-dp-attention: this rank's rounds with the others (srv.engine.dp_attention).
        runner = scheduler.runner
        self.lockstep = runner.tensor_parallel if runner.parallel.attention_data_parallel else None
        self.kv_events = self._kv_events_publisher()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work and not self.paused

    @property
    def wait_s(self) -> float:
        """How long to wait for a message before the next step: not at all while there is work
        (or deferred preparation in a pause), else a tenth of a second; with --sleep-on-idle a
        second once nothing is left to do in the pauses (a message ends any wait at once). A
        data-parallel attention rank waits as its rounds allow (DataParallelAttention.poll_s)."""
        if self.has_work or (self.scheduler.preparing_now and not self.paused):
            return 0.0
        if self.lockstep is not None:   # the other ranks' passes wait for this one's next round
            return self.lockstep.poll_s
        return IDLE_SLEEP_S if self.sleep_on_idle and self.scheduler.settled else 0.1

    def handle(self, message: Message) -> list[RequestOutput | ControlResult]:
        if isinstance(message, GenerateRequest):
            req = Req(message.rid, message.input_ids, message.params, priority=message.priority,
                      session_id=message.session_id, token_type_ids=message.token_type_ids)
            try:
                self.scheduler.add(req)
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    logger.exception("request %s could not be queued", req.rid)
                return [RequestOutput(message.rid, prompt_tokens=req.prompt_len, error=str(exc))]
            self._sent[req.rid] = 0
            return []
        if isinstance(message, AbortRequest):
            req = self.scheduler.abort(message.rid)
            return [self._output(req)] if req is not None else []
        method = getattr(self, f"control_{message.method}", None)
        if method is None:
            raise ValueError(f"unknown control method {message.method!r}")
        try:
            value = method(**message.args)
            if isinstance(value, WhenIdle):
                if self._deferred is not None:
                    raise ValueError("a weight update is already waiting for the running requests")
                self._deferred = (message.call_id, value.action)
                self.scheduler.hold_admission = True
                return self._run_deferred()
            result = ControlResult(message.call_id, value)
        except ValueError as exc:   # the caller's mistake (a bad mode, a profile already running)
            result = ControlResult(message.call_id, None, str(exc))
        outputs, self._control_outputs = self._control_outputs, []
        return [*outputs, result]

    def _run_deferred(self) -> list[RequestOutput | ControlResult]:
        """The deferred control call's result, once no request runs (none before)."""
        outputs, self._control_outputs = self._control_outputs, []
        if self._deferred is None or self.scheduler.running:
            return outputs
        (call_id, action), self._deferred = self._deferred, None
        self.scheduler.hold_admission = False
        try:
            result = ControlResult(call_id, action())
        except Exception as exc:   # a checkpoint that does not load: the served weights stay
            logger.exception("the control call failed")
            result = ControlResult(call_id, None, f"{type(exc).__name__}: {exc}")
        return [*outputs, result]

    def receives_now(self) -> bool:
        """Whether the loop takes the messages waiting now: always while idle, and every
        --scheduler-recv-interval steps while it works."""
        if self.has_work and self._steps_since_receive < self.recv_interval:
            return False
        self._steps_since_receive = 0
        return True

    def step(self) -> list[RequestOutput | ControlResult]:
        """One scheduler step, or --num-continuous-decode-steps decode steps in a row while the
        running requests decode and none waits; each request's new tokens in one output. A step
        that ran no pass ends with an idle round under data-parallel attention, else with a
        heartbeat to ranks on other nodes when one is due; under --kv-events-config the prefix
        cache's changes in the step are published."""
        runner = self.scheduler.runner
        passes = runner.passes
        outputs = self._step()
        if runner.passes == passes:
            if self.lockstep is not None:
                runner.idle_round()
            else:
                runner.keep_alive()
        if self.kv_events is not None:
            events = self.scheduler.tree.take_events()
            if events:
                self.kv_events.publish(KVEventBatch(time.time(), events, self.scheduler.args.data_parallel_rank))
        return outputs

    def _kv_events_publisher(self) -> KVEventPublisher | None:
        """--kv-events-config: the publisher it names, and the prefix cache set to record events."""
        args, tree = self.scheduler.args, self.scheduler.tree
        if not args.kv_events_config or tree is None:
            return None
        config = json.loads(args.kv_events_config)
        publisher = self.scheduler.runner.registry.choose("kv_events_publisher", config.get("publisher", "null"))
        tree.events = []
        return publisher.create(config, args.data_parallel_rank)

    def close(self) -> None:
        """The server is stopping: send the KV events still queued."""
        if self.kv_events is not None:
            self.kv_events.close()

    def _step(self) -> list[RequestOutput | ControlResult]:
        if self.paused:
            return []
        if self._deferred is not None:
            deferred = self._run_deferred()
            if deferred:
                return deferred
        stats = self.scheduler.stats
        stepped: list[Req] = []
        for _ in range(self.continuous_decode_steps):
            decoded = stats.decode_steps
            stepped += self._step_once()
            if stats.decode_steps == decoded or self.scheduler.waiting or not self.scheduler.running:
                break
        self._steps_since_receive += 1
        requests = {id(req): req for req in self.scheduler.take_failed() + stepped}
        return [self._output(req) for req in requests.values()]

    def _step_once(self) -> list[Req]:
        try:
            stepped = self.scheduler.step()
        except FloatingPointError:   # --crash-on-nan asks for the process to end
            raise
        except Exception as exc:
            logger.exception("a scheduler step failed; failing the requests it held")
            self.scheduler.fail_step(f"internal error: {type(exc).__name__}: {exc}")
            stepped = []
        self.profiler.after_step()
        if self.experts is not None and self.experts.active:
            counts = self.experts.after_pass()
            if counts is not None and not self._placing:   # a placement still moving finishes first
                self._rebalance_experts(counts)
        if self._placing:
            self._place_chunk()
        now, stats = time.monotonic(), self.scheduler.stats
        self._generated.append((now, stats.generated_tokens))
        while now - self._generated[0][0] > THROUGHPUT_WINDOW_S:
            self._generated.popleft()
        interval = self.scheduler.args.decode_log_interval
        if interval > 0 and stats.decode_steps - self._logged_decode_steps >= interval:
            self._logged_decode_steps = stats.decode_steps
            status = self.control_status()
            spec = f", accept len {stats.spec_accept_length:.2f}" if stats.spec_verifies else ""
            logger.info("decode: %d running, %d queued, %.1f tok/s, KV %d/%d tokens (%.0f%%), cache hit rate %.0f%%%s",
                        status["running_requests"], status["waiting_requests"], status["gen_throughput"],
                        status["kv_tokens_in_use"], status["kv_capacity_tokens"],
                        100 * status["kv_tokens_in_use"] / max(status["kv_capacity_tokens"], 1),
                        100 * stats.cached_prompt_tokens / max(stats.prompt_tokens, 1), spec)
        return stepped

    def throughput(self) -> float:
        """Generated tokens per second over the last few seconds."""
        if len(self._generated) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._generated[0], self._generated[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _output(self, req: Req) -> RequestOutput:
        sent = self._sent.get(req.rid, 0)
        out = RequestOutput(
            req.rid, req.output_ids[sent:], req.prompt_len, req.cached_tokens,
            req.finish_reason.value if req.finish_reason else None, req.matched_stop,
            req.logprobs[sent:], req.top_logprobs[sent:], req.error, req.token_ids_logprobs[sent:],
            embedding=req.embedding)
        if req.params.return_hidden_states:
            sent_hidden = self._sent_hidden.get(req.rid, 0)
            out.hidden_states = req.hidden_states[sent_hidden:]
            self._sent_hidden[req.rid] = len(req.hidden_states)
            if req.finished:
                self._sent_hidden.pop(req.rid, None)
        if req.params.logprob_start_len >= 0 and not req.input_logprobs_sent and req.next_prompt_logprob is None:
            out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            req.input_logprobs_sent = True
        if req.finished:
            self._sent.pop(req.rid, None)
        else:
            self._sent[req.rid] = len(req.output_ids)
        return out

    # ---- control methods --------------------------------------------------------------------

    def control_flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def control_clear_hicache_storage_backend(self) -> bool:
        """Remove every page the hierarchical cache's storage backend holds."""
        clear = getattr(self.scheduler.tree, "clear_storage", None)
        if clear is None:
            raise ValueError("no hierarchical cache storage: launch with --enable-hierarchical-cache and "
                             "--hicache-storage-backend")
        clear()
        return True

    def control_pause_generation(self, mode: str = "abort") -> bool:
        """Stop stepping. mode "abort" ends every request (as aborted), "retract" gives the
        running requests' KV back (they resume from the prefix cache), "in_place" keeps it all."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        scheduler = self.scheduler
        if mode == "abort":
            self._abort_all()
        elif mode == "retract":
            scheduler.retract_all("generation paused")
        self.paused = True
        logger.info("generation paused (%s)", mode)
        return True

    def _abort_all(self) -> None:
        for req in [*self.scheduler.running, *self.scheduler.queued]:
            self.scheduler.abort(req.rid)
            self._control_outputs.append(self._output(req))

    def control_continue_generation(self) -> bool:
        if self.released:
            raise ValueError("the memory is released: /resume_memory_occupation first")
        self.paused = False
        logger.info("generation continues")
        return True

    def control_load(self) -> dict[str, Any]:
        """SGLang's load: the KV tokens requests hold (the prefix cache's evictable pages are
        free to take, so not load) and the prompt tokens still queued."""
        scheduler = self.scheduler
        queued = scheduler.queued
        evictable = scheduler.tree.evictable_tokens if scheduler.tree is not None else 0
        return {"num_reqs": len(scheduler.running) + len(queued), "num_waiting_reqs": len(queued),
                "num_tokens": scheduler.kv_tokens_in_use() - evictable + sum(len(req.prompt_ids) for req in queued)}

    def control_update_weights_from_disk(self, model_path: str | None = None, load_format: str | None = None,
                                         abort_all_requests: bool = False) -> WhenIdle:
        """New weights from disk, once the running requests end (or at once, aborting every
        request); meanwhile waiting requests are not admitted. The prefix cache is emptied."""
        if self.released:
            raise ValueError("the memory is released: /resume_memory_occupation first")
        if abort_all_requests:
            self._abort_all()

        def update() -> dict[str, Any]:
            started = time.monotonic()
            self.scheduler.runner.reload_weights(model_path, load_format)
            self.scheduler.drop_prefix_cache()
            message = f"weights loaded from {model_path or 'the launch path'} in {time.monotonic() - started:.1f}s"
            logger.info("%s", message)
            return {"success": True, "message": message}

        return WhenIdle(update)

    def control_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return self.scheduler.runner.named_weight(name).detach().flatten()[:truncate_size].float().tolist()

    def control_release_memory_occupation(self, tags: list[str] | None = None) -> bool:
        """Drop the KV cache and/or the weights (all, by default) of an idle server; generation
        waits until they are resumed."""
        tags = set(tags or MEMORY_TAGS)
        if tags - set(MEMORY_TAGS):
            raise ValueError(f"tags {sorted(tags - set(MEMORY_TAGS))} are not among {', '.join(MEMORY_TAGS)}")
        scheduler = self.scheduler
        if scheduler.running or scheduler.waiting:
            raise ValueError("requests are running or waiting: the memory can be released only when idle")
        runner = scheduler.runner
        if "kv_cache" in tags:
            scheduler.drop_prefix_cache()
            runner.release_kv_cache()
        if "weights" in tags:
            runner.release_weights()
        self.released |= tags
        self.paused = True
        logger.info("memory released: %s", ", ".join(sorted(self.released)))
        return True

    def control_resume_memory_occupation(self, tags: list[str] | None = None) -> bool:
        tags = set(tags or MEMORY_TAGS) & self.released
        runner = self.scheduler.runner
        if "weights" in tags:
            runner.reload_weights()
        if "kv_cache" in tags:
            runner.allocate_kv_cache(self.scheduler.allocator.num_slots)
        self.released -= tags
        self.paused = bool(self.released)
        logger.info("memory resumed: %s", ", ".join(sorted(tags)) or "nothing was released")
        return True

    def control_load_lora_adapter(self, lora_name: str, lora_path: str) -> list[str]:
        """Load a PEFT adapter; returns the loaded adapters' names."""
        runner = self.scheduler.runner
        if runner.lora is None:
            raise ValueError("LoRA adapters need --enable-lora (or --lora-paths) at launch")
        try:
            adapter = runner.load_lora_adapter(lora_name, lora_path)
        except (OSError, KeyError) as exc:
            raise ValueError(f"adapter {lora_name}: {type(exc).__name__}: {exc}") from None
        runner.add_lora_adapter(adapter)
        logger.info("LoRA adapter %s loaded from %s", lora_name, lora_path)
        return runner.lora.names

    def control_unload_lora_adapter(self, lora_name: str) -> list[str]:
        """Unload an adapter no request uses (one in use is refused: its requests would change model)."""
        runner, scheduler = self.scheduler.runner, self.scheduler
        if runner.lora is None:
            raise ValueError("LoRA adapters need --enable-lora (or --lora-paths) at launch")
        users = [r for r in (*scheduler.running, *scheduler.waiting) if r.params.lora_path == lora_name]
        if users:
            raise ValueError(f"adapter {lora_name} serves {len(users)} request(s): unload it once they end")
        runner.remove_lora_adapter(lora_name)
        logger.info("LoRA adapter %s unloaded", lora_name)
        return runner.lora.names

    def control_close_session(self, session_id: str) -> bool:
        self.scheduler.unpin_session(session_id)
        return True

    def _expert_recorder(self) -> ExpertDistributionRecorder | None:
        """The recorder of a MoE model's routing (None for a dense model)."""
        runner, args = self.scheduler.runner, self.scheduler.args
        config = runner.config
        experts = config_num_experts(config)
        if not experts or getattr(runner, "moe", None) is None:
            return None
        recorder = ExpertDistributionRecorder(args.expert_distribution_recorder_mode,
                                              args.expert_distribution_recorder_buffer_size,
                                              config.num_hidden_layers, experts,
                                              bool(args.enable_expert_distribution_metrics),
                                              args.eplb_rebalance_num_iterations if args.enable_eplb else None)
        if recorder.active:
            runner.moe.on_routed = recorder.on_routed
        return recorder

    def _rebalance_experts(self, counts: Any) -> None:
        """--enable-eplb: place the experts anew by the tokens they received since the last time,
        unless the ranks' utilization under the current placement is above
        --eplb-min-rebalancing-utilization-threshold."""
        args, runner = self.scheduler.args, self.scheduler.runner
        current = {m.layer_id: m.slot_logical for m in runner.model.modules() if isinstance(m, FusedMoE)}
        ids = sorted(current)
        ranks = args.expert_parallel_size
        utilization = rank_utilization(counts[ids], [current[i] for i in ids], ranks)
        threshold = args.eplb_min_rebalancing_utilization_threshold
        if utilization > threshold:
            logger.info("expert placement kept: rank utilization %.3f is above "
                        "--eplb-min-rebalancing-utilization-threshold %.2f", utilization, threshold)
            return
        num_physical = counts.shape[1] + (args.ep_num_redundant_experts or 0)
        started = time.monotonic()
        plan = runner.eplb_algorithm.plan(counts, num_physical, ranks, *placement_span(args, runner.config))
        self._placing = [(i, plan[i]) for i in ids]   # placed from this step on (_place_chunk)
        logger.info("expert placement planned by %d routed tokens in %.3fs (balancedness %.3f, rank utilization "
                    "%.3f before)", int(counts.sum()), time.monotonic() - started, balancedness(counts), utilization)

    def _place_chunk(self) -> None:
        """Move the next --eplb-rebalance-layers-per-chunk layers (all, where unset) to their new placement."""
        chunk = self.scheduler.args.eplb_rebalance_layers_per_chunk or len(self._placing)
        rows, self._placing = self._placing[:chunk], self._placing[chunk:]
        self.scheduler.runner.set_expert_placement(dict(rows))

    def _recorder(self) -> ExpertDistributionRecorder:
        if self.experts is None:
            raise ValueError("the expert distribution is recorded for mixture-of-experts models; this one is dense")
        return self.experts

    def control_start_expert_distribution_record(self) -> bool:
        recorder = self._recorder()
        recorder.start()
        self.scheduler.runner.moe.on_routed = recorder.on_routed
        return True

    def control_stop_expert_distribution_record(self) -> bool:
        recorder = self._recorder()
        recorder.stop()
        if not recorder.active:   # the tap costs a bincount a layer: off when nothing reads it
            self.scheduler.runner.moe.on_routed = None
        return True

    def control_dump_expert_distribution_record(self, output_dir: str | None = None) -> dict[str, Any]:
        return self._recorder().dump(output_dir)

    def control_start_profile(self, **options: Any) -> str:
        return self.profiler.start(**options)

    def control_stop_profile(self) -> str:
        return self.profiler.stop()

    def control_status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "pid": os.getpid(),
            "running_requests": len(scheduler.running),
            "waiting_requests": len(scheduler.queued),
            "kv_tokens_in_use": scheduler.kv_tokens_in_use(),
            "kv_capacity_tokens": scheduler.allocator.capacity_tokens,
            "prefix_cached_tokens": scheduler.tree.cached_tokens if scheduler.tree is not None else 0,
            "hicache": scheduler.tree.stats() if scheduler.tree is not None else {},
            "gen_throughput": self.throughput(),
            **vars(scheduler.stats),
            "spec_accept_length": scheduler.stats.spec_accept_length,
            "expert_balancedness": self.experts.last_balancedness if self.experts is not None else None,
        }

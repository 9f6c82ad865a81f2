"""`--enable-trace`: one OpenTelemetry span per finished request, exported over OTLP/gRPC to
`--oltp-traces-endpoint`. OpenTelemetry is optional: `pip install 'srv[tracing]'`."""

from __future__ import annotations

import importlib.util
import time
from argparse import Namespace

from srv.engine.io import RequestOutput
from srv.engine.request_state import RequestState

REQUIRED = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc")


class RequestTracer:
    def __init__(self, args: Namespace) -> None:
        missing = [m for m in REQUIRED if importlib.util.find_spec(m.split(".")[0]) is None
                   or importlib.util.find_spec(m) is None]
        if missing:
            raise RuntimeError("--enable-trace needs OpenTelemetry (missing: " + ", ".join(missing) +
                               "): pip install 'srv[tracing]'")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "srv"}))
        exporter = OTLPSpanExporter(endpoint=args.oltp_traces_endpoint, insecure=True)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("srv")

    def observe(self, state: RequestState, out: RequestOutput) -> None:
        if not state.finished or state.params.max_new_tokens == 0:
            return
        # Request times are perf_counter readings; spans want wall-clock nanoseconds.
        offset = time.time_ns() - int(time.perf_counter() * 1e9)
        span = self.tracer.start_span("srv.request", start_time=offset + int(state.created_at * 1e9), attributes={
            "srv.rid": state.rid, "srv.prompt_tokens": len(state.prompt_ids),
            "srv.completion_tokens": len(state.output_ids), "srv.cached_tokens": state.cached_tokens,
            "srv.finish_reason": state.finish_reason or "error"})
        if state.first_token_at is not None:
            span.add_event("first_token", timestamp=offset + int(state.first_token_at * 1e9))
        span.end(end_time=offset + int((state.last_token_at or time.perf_counter()) * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()

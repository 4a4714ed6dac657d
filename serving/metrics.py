"""The server's Prometheus metrics (``GET /metrics``, the text format), in a registry of their own.

    flan_t5_queue_depth                        requests waiting for a slot
    flan_t5_running_slots / flan_t5_slots      slots decoding now (their last tokens on the way included) / in all
    flan_t5_generated_tokens_total             tokens generated
    flan_t5_prompt_tokens_total                prompt tokens read
    flan_t5_requests_total{outcome}            sequences ended: stop, length, cancelled (client gone), aborted
                                               (shutdown), error (a decoding call failed)
    flan_t5_rejected_requests_total{status}    responses of status 400 or more, by status (every refusal: 400,
                                               401, 404, 405, 408, 413, 415, 429, 431, 499 (the client went away
                                               first), 500, 503)
    flan_t5_time_to_first_token_seconds        histogram: arrival to the first token
    flan_t5_inter_token_latency_seconds        histogram: between two decoding calls' tokens of a sequence (a call's
                                               tokens come together: --steps_per_call of them)
    flan_t5_request_duration_seconds           histogram: arrival to the end
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
disable_created_metrics()  # no *_created series beside every counter and histogram: the process's start says it


class Metrics:
    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("flan_t5_queue_depth", "Requests waiting for a decoding slot", registry=r)
        self.running = Gauge("flan_t5_running_slots", "Decoding slots holding a request", registry=r)
        Gauge("flan_t5_slots", "Decoding slots in all", registry=r).set(slots)
        self.generated = Counter("flan_t5_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("flan_t5_prompt_tokens", "Prompt tokens read", registry=r)
        self.requests = Counter("flan_t5_requests", "Sequences ended, by outcome", ["outcome"], registry=r)
        self.rejected = Counter("flan_t5_rejected_requests", "Responses of status 400 or more, by status", ["status"],
                                registry=r)
        self.ttft = Histogram("flan_t5_time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram("flan_t5_inter_token_latency_seconds",
                             "Time between two decoding calls' tokens of a sequence", buckets=LATENCY, registry=r)
        self.duration = Histogram("flan_t5_request_duration_seconds", "Arrival to the end of a sequence",
                                  buckets=LATENCY, registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)

"""The server's Prometheus metrics, one registry per app (so tests and tenants never share state).

Names follow vLLM's where one exists, under `aviatorc_`; every series carries the `model` label:

    aviatorc_time_to_first_token_seconds      histogram  submit -> first token
    aviatorc_time_per_output_token_seconds    histogram  (last token - first token) / (tokens - 1), per request
    aviatorc_e2e_request_latency_seconds      histogram  submit -> finished
    aviatorc_generation_tokens_total          counter    tokens handed to requests
    aviatorc_prompt_tokens_total              counter
    aviatorc_generation_tokens_per_second     gauge      over the last 10 s
    aviatorc_num_requests_waiting / _running  gauge
    aviatorc_batch_occupancy                  gauge      running / KV slots after the last step
    aviatorc_decode_batch_size                histogram  sequences per decode step
    aviatorc_requests_total{outcome}          counter    stop, length, timeout, cancelled, error, shutdown, rejected
    aviatorc_spec_decode_draft_tokens_total / _accepted_tokens_total, _acceptance_rate
    aviatorc_spec_decode_num_drafts_total     counter    verifications (a sequence's drafts checked in a
                                                         step): tokens per verification = 1 + accepted / it
    aviatorc_prefix_cache_queries_total / _hits_total  counter  prompt tokens looked up / found cached
    aviatorc_num_preemptions_total{swapped}   counter    sequences preempted, their cache swapped out or not
    aviatorc_swap_space_bytes                 gauge      host memory held by swapped-out caches
    aviatorc_kv_cache_usage_perc              gauge      KV blocks in use / the pool's blocks
    aviatorc_kv_blocks{state}                 gauge      the pool's blocks: used, free; swapped (held in
                                                         host memory by preempted sequences); sram (used
                                                         blocks among those the plan keeps in SRAM)

The same series also appear under vLLM's own names (`VLLM_ALIASES`: `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, ...; the label `model_name`, finished requests as
`vllm:request_success_total{finished_reason}`), so that dashboards and autoscalers built for vLLM
read this server unchanged. They are the same values, renamed at exposition, never counted twice.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from aviatorc.serve.engine import GenerationRequest

# Buckets from 1 ms (a tiny model's step on this CPU) to a minute (a long prompt on a big one).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WINDOW_S = 10.0
# Our family -> vLLM's name for it (https://docs.vllm.ai/en/stable/usage/metrics/).
VLLM_ALIASES = {
    "aviatorc_num_requests_running": "vllm:num_requests_running",
    "aviatorc_num_requests_waiting": "vllm:num_requests_waiting",
    "aviatorc_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "aviatorc_prompt_tokens": "vllm:prompt_tokens",
    "aviatorc_generation_tokens": "vllm:generation_tokens",
    "aviatorc_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "aviatorc_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "aviatorc_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "aviatorc_requests": "vllm:request_success",
    "aviatorc_prefix_cache_queries": "vllm:prefix_cache_queries",
    "aviatorc_prefix_cache_hits": "vllm:prefix_cache_hits",
    "aviatorc_spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "aviatorc_spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "aviatorc_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "aviatorc_num_preemptions": "vllm:num_preemptions",
}
_FINISHED = ("stop", "length")  # the outcomes vLLM counts as request_success (its finished_reason)


class Registry:
    """The metric families of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model"]
        self.ttft = Histogram("aviatorc_time_to_first_token_seconds", "Time from submit to the first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("aviatorc_time_per_output_token_seconds", "Mean time between a request's tokens", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("aviatorc_e2e_request_latency_seconds", "Time from submit to finished", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.generated = Counter("aviatorc_generation_tokens", "Tokens generated", m, registry=r)
        self.prompt = Counter("aviatorc_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.rate = Gauge("aviatorc_generation_tokens_per_second", f"Tokens generated per second over the last "
                          f"{_WINDOW_S:g} s", m, registry=r)
        self.waiting = Gauge("aviatorc_num_requests_waiting", "Requests waiting for a KV slot", m, registry=r)
        self.running = Gauge("aviatorc_num_requests_running", "Requests holding a KV slot", m, registry=r)
        self.occupancy = Gauge("aviatorc_batch_occupancy", "Running sequences / KV slots", m, registry=r)
        self.batch = Histogram("aviatorc_decode_batch_size", "Sequences per decode step", m,
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.requests = Counter("aviatorc_requests", "Requests by outcome", [*m, "outcome"], registry=r)
        self.drafted = Counter("aviatorc_spec_decode_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted = Counter("aviatorc_spec_decode_accepted_tokens", "Draft tokens the target accepted", m,
                                registry=r)
        self.verifications = Counter("aviatorc_spec_decode_num_drafts", "Verifications of a sequence's drafts", m,
                                     registry=r)
        self.acceptance = Gauge("aviatorc_spec_decode_acceptance_rate", "Accepted / proposed draft tokens", m,
                                registry=r)
        self.prefix_queries = Counter("aviatorc_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      m, registry=r)
        self.prefix_hits = Counter("aviatorc_prefix_cache_hits", "Prompt tokens found in the prefix cache", m,
                                   registry=r)
        self.preemptions = Counter("aviatorc_num_preemptions", "Sequences preempted (swapped: their KV cache kept "
                                   "in host memory, else computed again on readmission)", [*m, "swapped"], registry=r)
        self.swap_space = Gauge("aviatorc_swap_space_bytes", "Host memory held by swapped-out KV caches", m, registry=r)
        self.kv_usage = Gauge("aviatorc_kv_cache_usage_perc", "KV blocks in use / blocks in the pool", m, registry=r)
        self.kv_blocks = Gauge("aviatorc_kv_blocks", "The KV pool's blocks (used, free), the blocks swapped-out "
                               "sequences hold in host memory (swapped), and the used blocks the plan keeps in SRAM "
                               "(sram)", [*m, "state"], registry=r)
        self.vllm = CollectorRegistry()
        self.vllm.register(_Aliases(self.registry))

    def exposition(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm)

    def model(self, name: str) -> Metrics:
        return Metrics(self, name)


class Metrics:
    """One model's series: the engine's `Observer`."""

    def __init__(self, families: Registry, model: str) -> None:
        self.f = families
        self.model = model
        self._recent: collections.deque[float] = collections.deque()
        self._drafted = self._accepted = 0

    def rejected(self) -> None:
        self.f.requests.labels(self.model, "rejected").inc()

    def queued(self, waiting: int, running: int, slots: int) -> None:
        self.f.waiting.labels(self.model).set(waiting)
        self.f.running.labels(self.model).set(running)
        self.f.occupancy.labels(self.model).set(running / slots if slots else 0.0)
        self._update_rate(time.monotonic())

    def first_token(self, request: GenerationRequest) -> None:
        assert request.first_token is not None
        self.f.ttft.labels(self.model).observe(request.first_token - request.submitted)

    def tokens(self, count: int) -> None:
        self.f.generated.labels(self.model).inc(count)
        now = time.monotonic()
        self._recent.extend([now] * count)
        self._update_rate(now)

    def decode_step(self, batch: int, slots: int) -> None:
        self.f.batch.labels(self.model).observe(batch)

    def finished(self, request: GenerationRequest) -> None:
        assert request.finished is not None
        now = time.monotonic()
        self.f.requests.labels(self.model, request.finished.reason).inc()
        self.f.prompt.labels(self.model).inc(len(request.prompt))
        self.f.e2e.labels(self.model).observe(now - request.submitted)
        if request.first_token is not None and len(request.generated) > 1:
            self.f.tpot.labels(self.model).observe((now - request.first_token) / (len(request.generated) - 1))

    def prefix_cache(self, queried: int, hit: int) -> None:
        self.f.prefix_queries.labels(self.model).inc(queried)
        self.f.prefix_hits.labels(self.model).inc(hit)

    def preempted(self, swapped: bool) -> None:
        self.f.preemptions.labels(self.model, str(swapped).lower()).inc()

    def swap_space(self, held_bytes: int) -> None:
        self.f.swap_space.labels(self.model).set(held_bytes)

    def kv_blocks(self, used: int, total: int, swapped: int, sram: int = 0) -> None:
        self.f.kv_usage.labels(self.model).set(used / total if total else 0.0)
        for state, count in (("used", used), ("free", total - used), ("swapped", swapped), ("sram", sram)):
            self.f.kv_blocks.labels(self.model, state).set(count)

    def speculated(self, proposed: int, accepted: int) -> None:
        self._drafted += proposed
        self._accepted += accepted
        self.f.drafted.labels(self.model).inc(proposed)
        self.f.accepted.labels(self.model).inc(accepted)
        self.f.verifications.labels(self.model).inc()
        self.f.acceptance.labels(self.model).set(self._accepted / self._drafted if self._drafted else 0.0)

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._drafted if self._drafted else 0.0

    def _update_rate(self, now: float) -> None:
        while self._recent and self._recent[0] < now - _WINDOW_S:
            self._recent.popleft()
        self.f.rate.labels(self.model).set(len(self._recent) / _WINDOW_S)


class _Aliases(Collector):
    """`VLLM_ALIASES`: the families of `source` under vLLM's names and labels, read at each scrape."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            alias = VLLM_ALIASES.get(family.name)
            if alias is None:
                continue
            metric = Metric(alias, family.documentation, family.type)
            for sample in family.samples:
                labels = dict(sample.labels)
                labels["model_name"] = labels.pop("model")
                if "outcome" in labels:
                    if labels["outcome"] not in _FINISHED:
                        continue
                    labels["finished_reason"] = labels.pop("outcome")
                metric.add_sample(alias + sample.name[len(family.name):], labels, sample.value, sample.timestamp)
            yield metric

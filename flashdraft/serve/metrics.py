"""Server metrics in the Prometheus text format (GET /metrics), written by hand (no client library).

    metrics.observe_request("/v1/chat/completions", 200, seconds=0.8)
    metrics.observe_generation(prompt_tokens=31, completion_tokens=16, acceptance_lengths=[3, 5, ...], seconds=0.7)
    text = metrics.render(queue_length=worker.queue_length, busy=worker.busy)

Counters only grow; gauges are computed at render time. Label values come from a fixed set
(known endpoints, HTTP statuses, error kinds) so hostile clients cannot blow up cardinality.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
QUANTILES = (0.5, 0.9, 0.99)


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    # nearest-rank on the sliding window
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


class Metrics:
    def __init__(self, window: int = 1000) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.finish: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rounds = 0
        self.accepted_tokens = 0  # Σ acceptance lengths: Σ / rounds = mean τ
        self.generation_seconds = 0.0
        self.latency_sum = 0.0
        self.latency_count = 0
        self._latencies: deque[float] = deque(maxlen=window)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        with self._lock:
            self.requests[(endpoint, int(status))] += 1
            if endpoint in ("/v1/chat/completions", "/v1/completions"):
                self.latency_sum += seconds
                self.latency_count += 1
                self._latencies.append(seconds)

    def observe_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def observe_generation(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        acceptance_lengths: list[int],
        seconds: float,
        finish_reason: str,
    ) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.rounds += len(acceptance_lengths)
            self.accepted_tokens += sum(acceptance_lengths)
            self.generation_seconds += seconds
            self.finish[finish_reason] += 1

    def render(self, *, queue_length: int, busy: bool, max_queue: int) -> str:
        with self._lock:
            lat = sorted(self._latencies)
            lines: list[str] = []

            def block(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    lines.append(f"{name}{labels} {_num(value)}")

            block(
                "flashdraft_requests_total",
                "counter",
                "HTTP requests by endpoint and status.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
            )
            block(
                "flashdraft_errors_total",
                "counter",
                "Failed requests by kind (server_error, timeout, cancelled, rejected_queue_full).",
                [(f'{{kind="{k}"}}', n) for k, n in sorted(self.errors.items())],
            )
            block(
                "flashdraft_generations_total",
                "counter",
                "Finished generations by finish reason.",
                [(f'{{finish_reason="{k}"}}', n) for k, n in sorted(self.finish.items())],
            )
            block(
                "flashdraft_prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                [("", self.prompt_tokens)],
            )
            block(
                "flashdraft_completion_tokens_total",
                "counter",
                "Completion tokens generated.",
                [("", self.completion_tokens)],
            )
            block(
                "flashdraft_rounds_total",
                "counter",
                "Decode rounds (one draft + one verify each).",
                [("", self.rounds)],
            )
            block(
                "flashdraft_accepted_tokens_total",
                "counter",
                "Sum of per-round acceptance lengths.",
                [("", self.accepted_tokens)],
            )
            block(
                "flashdraft_mean_acceptance_length",
                "gauge",
                "Mean tokens committed per round (tau), all time.",
                [("", self.accepted_tokens / self.rounds if self.rounds else float("nan"))],
            )
            block(
                "flashdraft_generation_seconds_total",
                "counter",
                "Wall time spent generating.",
                [("", self.generation_seconds)],
            )
            block(
                "flashdraft_tokens_per_second",
                "gauge",
                "Completion tokens per second of generation, all time.",
                [("", self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0)],
            )
            block(
                "flashdraft_queue_length", "gauge", "Requests waiting for the worker.", [("", queue_length)]
            )
            block("flashdraft_queue_capacity", "gauge", "Bound of the request queue.", [("", max_queue)])
            block("flashdraft_worker_busy", "gauge", "1 while the worker is generating.", [("", int(busy))])
            samples = [(f'{{quantile="{q}"}}', _quantile(lat, q)) for q in QUANTILES]
            lines.append(
                "# HELP flashdraft_request_latency_seconds Completion request latency "
                f"(quantiles over the last {self._latencies.maxlen} requests)."
            )
            lines.append("# TYPE flashdraft_request_latency_seconds summary")
            for labels, value in samples:
                lines.append(f"flashdraft_request_latency_seconds{labels} {_num(value)}")
            lines.append(f"flashdraft_request_latency_seconds_sum {_num(self.latency_sum)}")
            lines.append(f"flashdraft_request_latency_seconds_count {self.latency_count}")
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if v != v:
        return "NaN"
    return repr(float(v))

"""`/metrics` in the Prometheus text exposition format (version 0.0.4).

Written out here rather than with `prometheus_client`: the server exports a
handful of counters and gauges, no histograms, and the format for those is
a few lines per family; the client library would add a dependency and a
process-wide default registry for no gain. Request counts come from an ASGI
middleware that sees every response's status, streamed ones included."""

from __future__ import annotations

from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .generation import InFlight

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """What the server counts itself; the backend's counters are read at scrape time."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> responses
        self.prompt_tokens = 0  # prompt tokens of finished requests
        self.completion_tokens = 0  # tokens sent to clients

    def render(
        self, policy_version: int, backend: dict[str, int], inflight: InFlight, faults: list[dict[str, int]] = ()
    ) -> str:
        """The exposition text; `faults`: per actor position of a cluster, its
        `backend.FAULTS` (none in process: their families are left out)."""
        lines: list[str] = []
        _family(lines, "rollout_requests_total", "counter", "HTTP responses by endpoint and status.")
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'rollout_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
        scalars = [
            ("rollout_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("rollout_completion_tokens_total", "counter", "Generated tokens sent.", self.completion_tokens),
            ("rollout_requests_running", "gauge", "Generation requests admitted, not yet answered.", inflight.requests),
            (
                "rollout_inflight_tokens",
                "gauge",
                "Work of the requests in flight: prompts x n x (prompt tokens + max_tokens).",
                inflight.tokens,
            ),
            ("rollout_policy_version", "gauge", "Policy version of the weights serving now.", policy_version),
            ("rollout_kv_pages_used", "gauge", "KV cache pages in use.", backend["kv_pages_used"]),
            ("rollout_kv_pages_total", "gauge", "KV cache pages in all.", backend["kv_pages_total"]),
            ("rollout_computed_tokens_total", "counter", "Tokens the engine computed.", backend["computed_tokens"]),
            (
                "rollout_prefix_hit_tokens_total",
                "counter",
                "Prompt tokens whose KV the prefix cache supplied.",
                backend["prefix_hit_tokens"],
            ),
        ]
        for name, kind, help_text, value in scalars:
            _family(lines, name, kind, help_text)
            lines.append(f"{name} {value}")
        _actor_faults(lines, faults)
        return "\n".join(lines) + "\n"


# The watchdog's and the respawn path's outcomes per actor position, as `health()` counts them.
ACTOR_FAULTS = (
    ("rollout_actor_replacements_total", "Actors replaced at this position, for any reason.", "replacements", ""),
    ("rollout_actor_faults_total", "Actors the watchdog found hung or stalled (then replaced).", "hangs", "hung"),
    ("rollout_actor_faults_total", None, "stalls", "stalled"),
    ("rollout_actor_failed_starts_total", "Replacements killed unstarted (failed to load).", "failed_starts", ""),
)


def _actor_faults(lines: list[str], faults: list[dict[str, int]]) -> None:
    if not faults:
        return
    for name, help_text, key, fault in ACTOR_FAULTS:
        if help_text is not None:
            _family(lines, name, "counter", help_text)
        for actor in sorted(faults, key=lambda a: a["index"]):
            labels = f'actor="{actor["index"]}"' + (f',fault="{fault}"' if fault else "")
            lines.append(f"{name}{{{labels}}} {actor[key]}")


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class CountRequests:
    """ASGI middleware: counts each HTTP response by endpoint and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests[(endpoint, status or 500)] += 1

"""Prometheus metrics: a small thread-safe registry, the daemon's metrics, and an HTTP endpoint.

The endpoint serves the Prometheus text exposition format (version 0.0.4) at `/metrics`. It is off
unless `metrics_address` is set, and it binds only loopback unless `metrics_allow_remote` says
otherwise: the endpoint has no authentication and no TLS, and what it shows (tool names, error
rates, how many sessions are open, when revocations happen) tells an outsider what the agents are
doing. The ZeroMQ endpoint refuses tcp:// without CURVE for the same reason.

Rejected: `prometheus_client`. The format is a page of text and the registry a few dicts; a
dependency for that would be one more thing to audit in a security daemon.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sandboxd import protocol as p

log = logging.getLogger("sandboxd")

#: latency buckets in seconds: a trivial tool call takes milliseconds, a snapshot tens, a tool minutes
DEFAULT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 30.0, 60.0, 300.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[str, ...]


def _number(value: float) -> str:
    """A sample value as Prometheus spells it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    """HELP text escapes only backslash and newline (quotes stay as they are)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _sample(name: str, names: Labels, values: Labels, value: float) -> str:
    """One exposition line: `name{label="v",...} value`."""
    if not names:
        return f"{name} {_number(value)}"
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(names, values, strict=True))
    return f"{name}{{{labels}}} {_number(value)}"


class Family:
    """A metric family computed at scrape time (a gauge or a counter read from elsewhere)."""

    def __init__(self, name: str, kind: str, help_text: str, labels: Labels = (),
                 samples: dict[Labels, float] | None = None) -> None:
        self.name, self.kind, self.help, self.labels = name, kind, help_text, labels
        self.samples = samples or {}

    def lines(self) -> list[str]:
        """The family's sample lines, sorted by label values so scrapes diff cleanly."""
        return [_sample(self.name, self.labels, k, v) for k, v in sorted(self.samples.items())]


class Counter(Family):
    """A monotonically increasing count per label set."""

    def __init__(self, name: str, help_text: str, labels: Labels = ()) -> None:
        super().__init__(name, "counter", help_text, labels)
        self._lock = threading.Lock()

    def inc(self, *values: str, by: float = 1.0) -> None:
        """Add `by` (>= 0) to the sample with these label values."""
        assert by >= 0 and len(values) == len(self.labels), f"{self.name}: bad increment {values} by {by}"
        with self._lock:
            self.samples[values] = self.samples.get(values, 0.0) + by

    def value(self, *values: str) -> float:
        """The current count for these label values (0 if never incremented)."""
        with self._lock:
            return self.samples.get(values, 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            return super().lines()


class Histogram:
    """Observations counted into fixed cumulative buckets, per label set, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labels: Labels = (),
                 buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        assert list(buckets) == sorted(buckets), f"{name}: buckets must ascend"
        self.name, self.help, self.labels = name, help_text, labels
        self.bounds = (*buckets, math.inf)
        self._lock = threading.Lock()
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}  # counts per bound, [sum]

    def observe(self, value: float, *values: str) -> None:
        """Record one observation (seconds) for these label values."""
        with self._lock:
            counts, total = self._series.setdefault(values, ([0] * len(self.bounds), [0.0]))
            counts[next((i for i, bound in enumerate(self.bounds) if value <= bound), len(counts) - 1)] += 1
            total[0] += value

    def lines(self) -> list[str]:
        """Cumulative `_bucket{le=...}` lines, then `_sum` and `_count`, per label set."""
        out: list[str] = []
        with self._lock:
            series = sorted((k, (list(c), s[0])) for k, (c, s) in self._series.items())
        names = (*self.labels, "le")
        for values, (counts, total) in series:
            running = 0
            for bound, count in zip(self.bounds, counts, strict=True):
                running += count
                out.append(_sample(f"{self.name}_bucket", names, (*values, _number(bound)), running))
            out.append(_sample(f"{self.name}_sum", self.labels, values, total))
            out.append(_sample(f"{self.name}_count", self.labels, values, running))
        return out


Metric = Family | Histogram


class Registry:
    """Metrics by name, and collectors that produce families at scrape time."""

    def __init__(self) -> None:
        self._metrics: list[Metric] = []
        self._collectors: list[Callable[[], Iterable[Family]]] = []

    def counter(self, name: str, help_text: str, labels: Labels = ()) -> Counter:
        """Register and return a counter."""
        metric = Counter(name, help_text, labels)
        self._metrics.append(metric)
        return metric

    def histogram(self, name: str, help_text: str, labels: Labels = (),
                  buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> Histogram:
        """Register and return a histogram."""
        metric = Histogram(name, help_text, labels, buckets)
        self._metrics.append(metric)
        return metric

    def collect(self, collector: Callable[[], Iterable[Family]]) -> None:
        """Call `collector` at every scrape; its families are rendered after the registered metrics."""
        self._collectors.append(collector)

    def render(self) -> str:
        """The whole registry in the Prometheus text exposition format."""
        families: list[Metric] = [*self._metrics]
        for collector in self._collectors:
            families.extend(collector())
        out: list[str] = []
        for family in families:
            out.append(f"# HELP {family.name} {_escape_help(family.help)}")
            out.append(f"# TYPE {family.name} {family.kind}")
            out.extend(family.lines())
        return "\n".join(out) + "\n"


# The daemon's metrics ------------------------------------------------------------------------------

#: firewall counters shown even before they first move, so a dashboard never sees a missing series
FIREWALL_EVENTS = ("deduplicated", "fired", "staged", "orphaned")


class DaemonMetrics:
    """What the daemon counts at its error boundary, and what it reads from its parts when scraped."""

    def __init__(self, firewall_stats: Callable[[], Any], open_sessions: Callable[[], int],
                 effect_of: Callable[[str], str | None]) -> None:
        self.registry = r = Registry()
        self._firewall_stats, self._open_sessions, self._effect_of = firewall_stats, open_sessions, effect_of
        self.requests = r.counter("sandboxd_requests_total", "Requests answered, by wire type and outcome (ok, error).",
                                  ("type", "outcome"))
        self.errors = r.counter("sandboxd_errors_total", "Error replies by error code, undecodable frames included.",
                                ("code",))
        self.request_seconds = r.histogram("sandboxd_request_seconds", "Time to answer a request, by wire type.",
                                           ("type",))
        self.calls = r.counter("sandboxd_tool_calls_total", "Tool calls, by tool, effect class and outcome.",
                               ("tool", "effect", "outcome"))
        self.call_seconds = r.histogram("sandboxd_tool_call_seconds", "Time to answer a tool call, by effect class.",
                                        ("effect",))
        self.answered_now = r.counter("sandboxd_calls_answered_now_total",
                                      "Tool calls answered on the socket thread, without a worker (small reads "
                                      "of a session no other request is using).")
        self.snapshots = r.counter("sandboxd_snapshot_operations_total",
                                   "Snapshots taken and restored (agent checkpoints and revocations included), "
                                   "by operation and outcome.", ("op", "outcome"))
        self.snapshot_seconds = r.histogram("sandboxd_snapshot_operation_seconds",
                                            "Time to quiesce and snapshot or restore a sandbox, by operation.",
                                            ("op",))
        self.revocations = r.counter("sandboxd_revocations_total",
                                     "Revocations raised and committed, by state and by who raised them.",
                                     ("state", "raised_by"))
        r.collect(self._scraped)

    def observe(self, request: p.Request, reply: p.Response, seconds: float) -> None:
        """Count one answered request (the service's error boundary calls this for every request)."""
        kind = type(request).__name__
        code = reply.code if isinstance(reply, p.ErrorResponse) else None
        outcome = "error" if code else "ok"
        self.requests.inc(kind, outcome)
        self.request_seconds.observe(seconds, kind)
        if code:
            self.errors.inc(code)
        if isinstance(request, p.CallRequest):
            effect = self._effect_of(request.tool)
            # The tool name comes from the client: only registered names become label values, so a
            # stream of made-up names cannot grow the registry without bound.
            tool = request.tool if effect is not None else "(unknown)"
            self.calls.inc(tool, effect or "none", outcome)
            self.call_seconds.observe(seconds, effect or "none")

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Count and time a snapshot or restore; an exception counts it as an error and propagates."""
        started, outcome = time.perf_counter(), "error"
        try:
            yield
            outcome = "ok"
        finally:
            self.snapshots.inc(op, outcome)
            self.snapshot_seconds.observe(time.perf_counter() - started, op)

    def revocation(self, state: str, raised_by: str) -> None:
        """Count a revocation reaching `state` (raised, committed)."""
        self.revocations.inc(state, raised_by)

    def _scraped(self) -> list[Family]:
        """Families read from the firewall and the state store at scrape time, never double-counted."""
        stats = self._firewall_stats()
        events: dict[Labels, float] = {(name,): 0.0 for name in FIREWALL_EVENTS}
        events.update({(name,): float(n) for name, n in stats.counters.items()})
        return [
            Family("sandboxd_firewall_events_total", "counter",
                   "Firewall events since the daemon started (fired, deduplicated, staged, orphaned, ...).",
                   ("event",), events),
            Family("sandboxd_firewall_ledger_calls", "gauge", "External calls in the ledger, by state.",
                   ("state",), {(state,): float(n) for state, n in stats.states.items()}),
            Family("sandboxd_open_sessions", "gauge", "Sessions open now.", (), {(): float(self._open_sessions())}),
        ]


# The HTTP endpoint -------------------------------------------------------------------------------


def parse_metrics_address(address: str, allow_remote: bool = False) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) to (host, port); a non-loopback host needs `allow_remote`."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"metrics_address {address!r} must be HOST:PORT, e.g. 127.0.0.1:9464")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not allow_remote and not _is_loopback(host):
        raise ValueError(f"refusing to serve metrics on {address}: the endpoint has no authentication, so "
                         "it binds loopback only unless metrics_allow_remote = true")
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it could resolve anywhere
        return False


class _MetricsHandler(BaseHTTPRequestHandler):
    registry: Registry
    #: a scraper that stops reading must not hold a server thread for ever
    timeout = 10

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = self.registry.render().encode()
        except Exception:
            log.exception("rendering metrics failed")
            self.send_error(500, "rendering metrics failed")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # The default writes every scrape to stderr, which is the daemon's JSON log.
        log.debug("metrics: " + format, *args)


class MetricsServer:
    """Serves one registry at http://HOST:PORT/metrics from a daemon thread until `stop()`."""

    def __init__(self, host: str, port: int, registry: Registry) -> None:
        handler = type("MetricsHandler", (_MetricsHandler,), {"registry": registry})
        server_class = _Server6 if ":" in host else ThreadingHTTPServer
        self._httpd = server_class((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="sandboxd-metrics", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): the port is the real one when 0 was asked."""
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6

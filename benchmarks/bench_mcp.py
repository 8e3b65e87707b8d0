"""A trivial tool call through `sandboxd mcp` (stdio and streamable HTTP, the SDK's own client) against
the same call through the Python client (`sandboxd call`'s path), interleaved in one run.

An MCP call costs the daemon call plus the MCP round trip and the session's record: the call and its
result are recorded as provenance and a checkpoint is registered before the result is handed over
(three more daemon requests; a write-class call's checkpoint also snapshots the sandbox).

    .venv/bin/python -m benchmarks.bench_mcp [--n 200]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from benchmarks._harness import daemon, pct
from tests.sinks import free_port

TOKEN = "bench-token-" + "b" * 24
CALLS: dict[str, tuple[str, dict[str, Any], str]] = {
    "read_file": ("read_file", {"path": "f.txt"}, "ok\n"),
    "shell echo": ("shell", {"command": "echo ok"}, "ok\n"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    with daemon() as proc:
        timings = anyio.run(run, proc.endpoint, args.n)
    print(f"trivial calls through sandboxd, n={args.n} each, interleaved")
    for call in CALLS:
        base = pct(timings[(call, "python client")], 50)
        for path in ("python client", "mcp stdio", "mcp http"):
            samples = timings[(call, path)]
            p50, p95 = pct(samples, 50) * 1000, pct(samples, 95) * 1000
            print(f"  {call:10s} {path:14s} p50 {p50:7.2f} ms   p95 {p95:7.2f} ms   p50 x{p50 / 1000 / base:4.1f}")


async def run(endpoint: str, n: int) -> dict[tuple[str, str], list[float]]:
    port = free_port()
    http_server = subprocess.Popen(
        [sys.executable, "-m", "sandboxd.cli", "mcp", "--endpoint", endpoint, "--transport", "http", "--port",
         str(port), "--token", TOKEN], stderr=subprocess.DEVNULL)
    try:
        await _wait_listening(port)
        stdio = StdioServerParameters(command=sys.executable, args=["-m", "sandboxd.cli", "mcp", "--endpoint",
                                                                    endpoint])
        async with Client(stdio) as over_stdio, \
                create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"}) as http, \
                Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http)) as over_http:
            from sandboxd.client import Client as DaemonClient

            direct = DaemonClient(endpoint)
            session = direct.open_session().session_id
            paths: dict[str, Any] = {
                "python client": lambda tool, a: _direct(direct, session, tool, a),
                "mcp stdio": lambda tool, a: _mcp(over_stdio, tool, a),
                "mcp http": lambda tool, a: _mcp(over_http, tool, a),
            }
            for call in paths.values():
                await call("write_file", {"path": "f.txt", "content": "ok\n"})
            timings: dict[tuple[str, str], list[float]] = {(c, p): [] for c in CALLS for p in paths}
            for i in range(n + 5):  # five warm-up rounds
                for name, (tool, call_args, expected) in CALLS.items():
                    for path, call in paths.items():
                        start = time.perf_counter()
                        got = await call(tool, call_args)
                        elapsed = time.perf_counter() - start
                        assert got == expected, (path, got)
                        if i >= 5:
                            timings[(name, path)].append(elapsed)
            direct.close_session(session)
            direct.close()
            return timings
    finally:
        http_server.terminate()
        http_server.wait(timeout=60)


def _direct(client: Any, session: str, tool: str, args: dict[str, Any]) -> Any:
    async def call() -> str:
        return str(client.call(session, tool, args).stdout)
    return call()


async def _mcp(client: Client, tool: str, args: dict[str, Any]) -> str:
    result = await client.call_tool(tool, args)
    assert not result.is_error, result
    return "".join(getattr(block, "text", "") for block in result.content)


async def _wait_listening(port: int) -> None:
    for _ in range(600):
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            await anyio.sleep(0.1)
            continue
        await stream.aclose()
        return
    raise RuntimeError("sandboxd mcp did not listen")


if __name__ == "__main__":
    main()

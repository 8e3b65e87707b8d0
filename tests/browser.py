"""The console in a real browser: Debian's chromium driven through its chromedriver, and a 300-node session.

Shared by the browser tests and benchmarks/bench_console.py.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from sandboxd import protocol as p
from sandboxd.client import Client
from sandboxd.console.app import SHUTDOWN_GRACE_S, Console, build_app
from tests.sinks import free_port


def chrome() -> Any:
    """A headless chromium (the system's, never a downloaded one)."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(service=service, options=options)


@contextmanager
def serve_console(app: Console) -> Iterator[str]:
    """The console served by uvicorn on a free loopback port, in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(app), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def big_graph(client: Client, sid: str, turns: int = 75) -> list[str]:
    """A session of 4 artifacts per turn (300 in all) with a checkpoint per turn; returns the observation ids."""
    arts, prev, observations = [p.Artifact(artifact_id="u0", type="user", content="the task")], "u0", []
    for t in range(1, turns + 1):
        arts += [p.Artifact(artifact_id=f"turn-{t}", type="model_turn", parents=[prev], turn=t, step=t - 1,
                            content=f"I will look at item {t}"),
                 p.Artifact(artifact_id=f"call-{t}", type="tool_call", parents=[f"turn-{t}"], turn=t, step=t - 1),
                 p.Artifact(artifact_id=f"obs-{t}", type="observation", parents=[f"call-{t}"], turn=t, step=t,
                            content=f"item {t} says hello"),
                 p.Artifact(artifact_id=f"plan-{t}", type="plan", parents=[f"obs-{t}"], turn=t, step=t)]
        prev = f"plan-{t}"
        observations.append(f"obs-{t}")
    client.record_artifacts(sid, arts[:-1])
    client.checkpoint(sid, p.CheckpointRecord(checkpoint_id="cp-0", step=0, turn=0, token_offset=0, cache_handle="c",
                                              reason="start"), snapshot=False)
    return observations

"""`python -m agent.eval --ray ADDRESS`: the evaluation's pairs fanned out over a Ray cluster.

The pairs of a suite are cut into as many chunks as the cluster has CPUs (or `tasks`); each chunk is
one Ray task that sets up its own worlds (three daemons, mail and web sinks) on the node Ray runs it on
and runs its pairs there, exactly as `evaluate` does on one machine. The rows come back to the driver
and are aggregated once, so the table is the one a single-machine run prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _pair_names(suite: str) -> list[str]:
    from agent.eval.runner import Web, suite_pairs

    web = Web({})  # builtin pairs name the web's URLs; only their names are needed here
    try:
        return [pair.name for pair in suite_pairs(suite, web)]
    finally:
        web.close()


def _chunk(suite: str, names: Sequence[str], release: str, only: Sequence[str], model: bool) -> dict[str, Any]:
    from agent.eval.runner import evaluate

    return evaluate(suite, names, release, only=only, model=model, progress=lambda _: None)


def evaluate_on_ray(address: str, suite: str, names: Sequence[str], release: str = "immediate",
                    limit: int | None = None, only: Sequence[str] = (), model: bool = False,
                    tasks: int | None = None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Like `runner.evaluate`, with the pairs run as Ray tasks over the cluster at `address`."""
    import ray

    from agent.eval.runner import aggregate

    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    pairs = [name for name in _pair_names(suite) if not only or name in only][:limit]
    width = max(1, min(len(pairs), tasks or int(ray.cluster_resources().get("CPU", 1))))
    chunks = [pairs[i::width] for i in range(width)]
    run = ray.remote(num_cpus=1)(_chunk)
    progress(f"[{suite} {release}] {len(pairs)} pairs in {width} Ray tasks")
    results = ray.get([run.remote(suite, list(names), release, chunk, model) for chunk in chunks if chunk])
    merged: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for result in results:
        for name in names:
            merged[name] += result[name]["rows"]
    order = {name: i for i, name in enumerate(pairs)}
    return {name: aggregate(sorted(rows, key=lambda r: order.get(r["pair"], 0))) for name, rows in merged.items()}

"""What a running container uses now, read from its cgroup files on the host (no engine round trip).

`docker stats` takes a second or more per container (it waits for a second sample); a sessions list must
stay cheap enough to answer on the daemon's socket thread, so the kernel's counters are read directly.
Both cgroup layouts and both of Docker's cgroup drivers are looked for; where none is found (another
engine, a rootless one, the local test sandbox) the usage is simply empty.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def container_usage(container_id: str | None, root: Path = CGROUP_ROOT) -> dict[str, float | int]:
    """memory_bytes, cpu_s and pids of a container's cgroup, those that can be read."""
    if not container_id or "/" in container_id or container_id.startswith("."):
        return {}
    usage: dict[str, float | int] = {}
    for base in (root / "system.slice" / f"docker-{container_id}.scope", root / "docker" / container_id):
        if (base / "cgroup.controllers").exists():  # v2: one directory holds every controller
            memory, pids = _read_int(base / "memory.current"), _read_int(base / "pids.current")
            cpu = _cpu_v2(base / "cpu.stat")
            usage.update({k: v for k, v in (("memory_bytes", memory), ("cpu_s", cpu), ("pids", pids))
                          if v is not None})
            return usage
    for parent in ("docker", f"system.slice/docker-{container_id}.scope"):
        leaf = container_id if parent == "docker" else ""
        memory = _read_int(root / "memory" / parent / leaf / "memory.usage_in_bytes")
        cpu_ns = _read_int(root / "cpuacct" / parent / leaf / "cpuacct.usage")
        pids = _read_int(root / "pids" / parent / leaf / "pids.current")
        if memory is not None or cpu_ns is not None or pids is not None:
            if memory is not None:
                usage["memory_bytes"] = memory
            if cpu_ns is not None:
                usage["cpu_s"] = round(cpu_ns / 1e9, 3)
            if pids is not None:
                usage["pids"] = pids
            return usage
    return usage


def start_time(pid: int, proc: Path = Path("/proc")) -> str | None:
    """When host process `pid` started (clock ticks since boot, its stat's field 22), or None when there is none:
    with the pid, it names one process, which a pid alone does not once the pid is reused."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _cpu_v2(path: Path) -> float | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return round(int(value) / 1e6, 3)
    except (OSError, ValueError):
        return None
    return None

"""What the gVisor runtime (runsc) needs of the engine and of a sandbox's options."""

from __future__ import annotations

import functools
import json
import os
import signal
from importlib import resources

RUNSC_ARGS = {
    # gVisor's own network stack cannot start in the root network namespace, and a sandbox has none.
    "--network=none": "the sandbox could not start",
    # A unix socket bound inside gVisor lives in its kernel; `create` lets the sandbox make it a host
    # socket in its bind mounts (and nothing more: `open`, connecting to host sockets, stays off).
    "--host-uds=create": "the executor's socket would not be reachable from the daemon",
    # Without it gVisor ignores the container's seccomp profile, and unshare(CLONE_NEWUSER) succeeds.
    "--oci-seccomp": "a tool could create user and mount namespaces",
}
"""Arguments the engine's runsc runtime must carry, with what goes wrong without each."""

# Limits under gVisor. The sandbox is one host process tree (gVisor's kernel and, on its ptrace
# platform, a stub process per address space with a thread per tracer: a 128-process shell fork
# bomb peaked at 2,420 host tasks). The host pids cgroup counts those, and gVisor's kernel dies when
# it cannot make a thread; so the pids limit is enforced inside, as RLIMIT_NPROC, which gVisor counts
# per sandbox (under runc it would count the uid's processes across every container and the host).
# The host cgroup stays as a ceiling. Memory is the host cgroup's for both runtimes: under gVisor
# its OOM kill takes the whole sandbox, which `stop_cause` reports and `ensure_running` restarts.
HOST_TASKS_PER_PID = 32


def halt(pid: int) -> None:
    """End a gVisor sandbox at once by killing its host process (`pid`: the container's init as the engine
    reports it, which under runsc is the sandbox's kernel), so the engine finds it exited.

    The engine's own stop has runsc ask that kernel to end its tasks: a sandbox worn by a fork bomb (2,450
    host tasks) took 73 s to stop with the host's two cores busy, past the engine client's timeout, where
    this and a wait for the engine to see the sandbox exit took 0.3 s (a stop after this is no shortcut:
    runsc asks a kernel that is gone, 23 s). Nothing is lost that a stop would keep: the workspace is a
    bind mount that a write reaches when it is made, and the scratch tmpfs goes with the sandbox anyway."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@functools.cache
def runsc_seccomp_profile() -> str:
    """Docker's default seccomp profile, as runsc can enforce it, for a container's security options.

    `seccomp-docker-default.json` is moby's profiles/seccomp/default.json of v20.10.24 (Apache-2.0), the
    engine Debian bookworm ships, unchanged. That profile answers clone3 with ENOSYS so that glibc falls
    back to clone, whose flags it can filter; gVisor 20221219 enforces the rule with EPERM instead, and
    glibc then fails every pthread_create. Here clone3 is allowed: this gVisor does not implement it and
    answers ENOSYS itself (tests/integration/test_hardening.py checks that no namespace can be made).
    """
    profile = json.loads(resources.files("sandboxd.sandbox").joinpath("seccomp-docker-default.json").read_text())
    rules = [rule for rule in profile["syscalls"] if rule["names"] != ["clone3"]]
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ALLOW"})
    profile["syscalls"] = rules
    return json.dumps(profile)

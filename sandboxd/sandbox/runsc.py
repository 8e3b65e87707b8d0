"""What the gVisor runtime (runsc) needs of the engine and of a sandbox's options."""

from __future__ import annotations

import functools
import json
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

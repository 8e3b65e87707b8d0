#!/usr/bin/env bash
# Makes gVisor's runsc available to the Docker engine as the runtime "runsc": installs Debian's runsc
# package when it is missing, and registers it in the engine's daemon.json. The registration merges
# into whatever daemon.json already holds and is written only when it differs, so running this again
# changes nothing; after a change the engine reloads its configuration on SIGHUP (never a restart:
# other containers keep running).
#
# The runtime's arguments: --network=none, because gVisor's own network stack cannot start in the
# root network namespace ("cannot run with network enabled in root network namespace") and a sandbox
# has no network anyway; --host-uds=create, so the executor's unix socket, bound inside the sandbox,
# is a host socket the daemon can connect to; --oci-seccomp, so the container's seccomp profile is
# enforced inside gVisor too (without it a tool can unshare a user namespace).
set -euo pipefail
CONFIG=${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
RUNSC=${RUNSC:-/usr/bin/runsc}

if [[ ! -x $RUNSC ]]; then
  echo "installing runsc (gVisor)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc >/dev/null
fi

changed=$(python3 - "$CONFIG" "$RUNSC" <<'EOF'
import json, os, sys
path, runsc = sys.argv[1], sys.argv[2]
# Keep in step with RUNSC_ARGS in sandboxd/sandbox/containers.py, which says why each is needed.
want = {"path": runsc, "runtimeArgs": ["--network=none", "--host-uds=create", "--oci-seccomp"]}
try:
    with open(path) as fh:
        config = json.load(fh)
except FileNotFoundError:
    config = {}
if not isinstance(config, dict):
    sys.exit(f"{path} is not a JSON object; not touching it")
runtimes = config.setdefault("runtimes", {})
if runtimes.get("runsc") == want:
    print("no")
    sys.exit(0)
runtimes["runsc"] = want
os.makedirs(os.path.dirname(path), exist_ok=True)
tmp = path + ".sandboxd.tmp"
with open(tmp, "w") as fh:
    json.dump(config, fh, indent=2)
    fh.write("\n")
os.replace(tmp, path)
print("yes")
EOF
)

# Registered as written, arguments included (the engine answers with the old ones until it reloads).
registered() {
  local seen
  seen=$(docker info --format '{{json .Runtimes.runsc}}' 2>/dev/null) || return 1
  for arg in --network=none --host-uds=create --oci-seccomp; do
    [[ $seen == *"\"$arg\""* ]] || return 1
  done
}

if [[ $changed == yes ]] || ! registered; then
  pid=$(pidof dockerd || true)
  if [[ -z $pid ]]; then
    echo "no dockerd is running; start it (docker/ensure-engine.sh) and run this again" >&2
    exit 1
  fi
  echo "registering runsc with the Docker engine (SIGHUP to dockerd $pid)"
  kill -HUP $pid
  for _ in $(seq 1 60); do
    registered && break
    sleep 0.5
  done
fi
if ! registered; then
  echo "the Docker engine did not pick up the runsc runtime; see $CONFIG" >&2
  exit 1
fi
echo "runtime runsc registered"

#!/usr/bin/env bash
# Makes sure a Docker engine answers: installs Debian's docker.io when dockerd is missing, starts
# dockerd when the socket does not answer, and waits until it does.
set -euo pipefail
LOG=${DOCKERD_LOG:-/var/log/sandboxd-dockerd.log}

if docker info >/dev/null 2>&1; then
  exit 0
fi
if ! command -v dockerd >/dev/null; then
  echo "installing docker.io"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: $LOG)"
  # setsid: the engine must outlive the make process that started it.
  setsid nohup dockerd >"$LOG" 2>&1 < /dev/null &
fi
for _ in $(seq 1 120); do
  if docker info >/dev/null 2>&1; then
    echo "docker engine up"
    exit 0
  fi
  sleep 0.5
done
echo "docker engine did not come up; see $LOG" >&2
tail -n 20 "$LOG" >&2 || true
exit 1

#!/usr/bin/env bash
# Builds the tool image offline: bootstrap a minimal Debian root filesystem from the host's own apt
# sources (mmdebstrap with no mirror argument), import it as the base image, then build the tool
# image FROM it, with a small statx shim (docker/statx-compat.c) compiled on the host. Does nothing
# when the image already exists (FORCE=1 rebuilds).
set -euo pipefail
# Keep in step with DEFAULT_IMAGE in sandboxd/config.py; bump the tag when the image contents change.
IMAGE=${IMAGE:-sandboxd-tool:bookworm-v3}
BASE=${BASE:-sandboxd-base:bookworm-v2}
SUITE=${SUITE:-bookworm}
here=$(cd "$(dirname "$0")" && pwd)
tmp="" context=""
trap 'rm -rf ${tmp:+"$tmp"} ${context:+"$context"}' EXIT

if [[ -z ${FORCE:-} ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "image $IMAGE present"
  exit 0
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1 || [[ -n ${FORCE:-} ]]; then
  if ! command -v mmdebstrap >/dev/null; then
    echo "installing mmdebstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
  fi
  tmp=$(mktemp -d)
  echo "bootstrapping a $SUITE root filesystem (python3, libfaketime) from the host's apt sources"
  mmdebstrap --quiet --variant=apt --include=python3,libfaketime "$SUITE" "$tmp/rootfs.tar"
  docker import "$tmp/rootfs.tar" "$BASE" >/dev/null
fi
if ! command -v gcc >/dev/null || [[ ! -e /usr/include/stdio.h ]]; then
  echo "installing gcc (for the image's statx shim)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null
fi
context=$(mktemp -d)
cp "$here/Dockerfile" "$context/"
# The host is the image's release (bookworm), so what it compiles runs in the image.
gcc -O2 -Wall -Werror -shared -fPIC -o "$context/statx-compat.so" "$here/statx-compat.c"
echo "building $IMAGE FROM $BASE"
docker build --quiet --build-arg BASE="$BASE" -t "$IMAGE" "$context" >/dev/null
echo "image $IMAGE built"

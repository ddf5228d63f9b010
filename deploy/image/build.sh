#!/usr/bin/env bash
# Build tandem's CPU container image with podman: `make image` (or deploy/image/build.sh).
#
#   deploy/image/build.sh              build the image; prints its name at the end
#   deploy/image/build.sh name         print the image name the build tags (deploy/k8s uses it)
#   deploy/image/build.sh run-flags    print the podman flags that run it on such a machine
#
# The base: a Debian bookworm root filesystem made with mmdebstrap from Debian's archive and
# imported with `podman import` (no container registry needed), unless TANDEM_BASE_IMAGE names
# one (e.g. debian:bookworm-slim or python:3.11-slim where a registry is reachable).
# Torch 2.13.0 CPU: TANDEM_TORCH_SOURCE=auto (default: a torch-2.13.0+cpu wheel from the wheel
# directories pip's find-links name, or TANDEM_WHEEL_DIR, else the index), local (that wheel,
# required) or an index URL (e.g. https://download.pytorch.org/whl/cpu).
# Podman runs with --runtime runc (crun fails on hybrid cgroups) and explicit ulimits (podman's
# defaults can exceed what a sandbox allows): TANDEM_ULIMIT_NOFILE (default: the hard limit,
# at most 65536) and TANDEM_ULIMIT_NPROC (default 4096).
set -euo pipefail
cd "$(dirname "$0")/../.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
IMAGE=${TANDEM_IMAGE:-localhost/tandem:$version}
TORCH_VERSION=$(sed -n 's/.*torch==\([0-9.]*\).*/\1/p' Makefile | head -1)
nofile=$(ulimit -Hn)
if [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; then nofile=65536; fi
NOFILE=${TANDEM_ULIMIT_NOFILE:-$nofile}
NPROC=${TANDEM_ULIMIT_NPROC:-4096}
RUN_FLAGS=(--runtime runc --ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")

case "${1:-build}" in
  name) echo "$IMAGE"; exit 0 ;;
  run-flags) echo "${RUN_FLAGS[*]}"; exit 0 ;;
  build) ;;
  *) echo "usage: $0 [build|name|run-flags]; got '$1'" >&2; exit 2 ;;
esac

say() { echo "build.sh: $*" >&2; }
started=$SECONDS
source=${TANDEM_TORCH_SOURCE:-auto}
case "$source" in
  auto | local | http://* | https://* | file://*) ;;
  *) say "TANDEM_TORCH_SOURCE='$source'; expected auto, local or an index URL"; exit 2 ;;
esac

# --- tools, from Debian's archive where missing
need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
[ -n "${TANDEM_BASE_IMAGE:-}" ] || command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  say "installing ${need[*]} (Debian)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${need[@]}" uidmap
fi

# --- the base image
# what the image needs from Debian: python3.11 with venv, gcc for the native kernels that
# compile for the CPU they run on (and Python's headers for the one CPython extension), CA
# certificates for TLS
PACKAGES=python3,python3-venv,ca-certificates,gcc,libc6-dev,libpython3.11-dev
# the Debian archive this host's apt already uses (deb822 or one-line sources), unless given
apt_uri() {  # $1: the archive's last path part, debian or debian-security
  cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | sed -n -e 's|^URIs:[[:space:]]*||p' -e 's|^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?||p' \
    | tr ' ' '\n' | grep -E "^https?://[^[:space:]]+/$1/?$" | head -1 | sed 's|/$||' || true
}
MIRROR=${TANDEM_DEBIAN_MIRROR:-$(apt_uri debian)}
SECURITY=${TANDEM_DEBIAN_SECURITY:-$(apt_uri debian-security)}
if [ -z "${TANDEM_BASE_IMAGE:-}" ] && { [ -z "$MIRROR" ] || [ -z "$SECURITY" ]; }; then
  say "no Debian archive found in this host's apt sources; set TANDEM_DEBIAN_MIRROR and"
  say "TANDEM_DEBIAN_SECURITY (URLs ending in /debian and /debian-security)"
  exit 1
fi
if [ -n "${TANDEM_BASE_IMAGE:-}" ]; then
  BASE=$TANDEM_BASE_IMAGE
else
  key=$(printf '%s\n' "$PACKAGES" "$MIRROR" "$SECURITY" | sha256sum | cut -c1-12)
  BASE=localhost/tandem-base:bookworm-$key
  if podman image exists "$BASE"; then
    say "base $BASE exists"
  else
    say "making the base root filesystem with mmdebstrap (bookworm: $PACKAGES)"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --variant=minbase --include="$PACKAGES" \
      --aptopt='APT::Install-Recommends "false"' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      bookworm "$tmp/rootfs.tar" \
      "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
      "deb $SECURITY bookworm-security main"
    podman import --change 'CMD ["/bin/bash"]' "$tmp/rootfs.tar" "$BASE" >/dev/null
    rm -rf "$tmp"
    trap - EXIT
  fi
fi

# --- where torch comes from
WHEELS=deploy/image/wheels  # in the build context; its *.whl are not committed
rm -f "$WHEELS"/*.whl
trap 'rm -f "$WHEELS"/*.whl' EXIT
wheel=""
if [ "$source" = auto ] || [ "$source" = local ]; then
  dirs=${TANDEM_WHEEL_DIR:-}
  if [ -z "$dirs" ]; then
    py=$(command -v python3 || true)
    if [ -n "$py" ]; then
      dirs=$("$py" -m pip config get global.find-links 2>/dev/null || true)
    fi
    dirs="$dirs ${PIP_FIND_LINKS:-}"
  fi
  for d in $dirs; do
    d=${d#file://}
    for f in "$d"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-*linux*_x86_64.whl; do
      if [ -f "$f" ]; then wheel=$f; break 2; fi
    done
  done
  if [ -z "$wheel" ] && [ "$source" = local ]; then
    say "TANDEM_TORCH_SOURCE=local: no torch-$TORCH_VERSION+cpu cp311 wheel in: ${dirs:-(no dirs)}"
    exit 1
  fi
fi
if [ -n "$wheel" ]; then
  ln "$wheel" "$WHEELS/" 2>/dev/null || cp "$wheel" "$WHEELS/"
  TORCH_INDEX=local
  say "torch: $wheel"
elif [ "$source" = auto ]; then
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
  say "torch: no local wheel, from $TORCH_INDEX"
else
  TORCH_INDEX=$source
fi

# pip inside the build trusts what pip here trusts (a TLS-inspecting proxy's CA, if any): a
# build secret, never a layer of the image
cert=${PIP_CERT:-}
if [ -z "$cert" ] && command -v python3 >/dev/null; then
  cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
fi
[ -n "$cert" ] && [ -f "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
secret=()
if [ -f "$cert" ]; then secret=(--secret "id=pip_cert,src=$cert"); fi

say "building $IMAGE from $BASE"
podman build "${RUN_FLAGS[@]}" --format docker --layers \
  "${secret[@]}" \
  --build-arg "BASE_IMAGE=$BASE" \
  --build-arg "TORCH_INDEX=$TORCH_INDEX" \
  --build-arg "TORCH_VERSION=$TORCH_VERSION" \
  --label "org.opencontainers.image.version=$version" \
  -t "$IMAGE" -f Dockerfile .
rm -f "$WHEELS"/*.whl
say "built $IMAGE in $((SECONDS - started)) s"
echo "$IMAGE"

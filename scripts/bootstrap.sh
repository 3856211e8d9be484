#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12/13 machine (as root) for dsec:
# apt packages, then a .venv at the repo root with dsec installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  python3 python3-venv python3-dev gcc libc6-dev make libseccomp-dev
  crun runc erofs-utils busybox-static debootstrap bubblewrap
  iproute2 nftables fuse3 libfuse3-dev pkg-config curl ca-certificates util-linux
  qemu-system-x86 qemu-utils lz4 e2fsprogs cpio docker-registry openssl
  libfuse3-3 git postgresql
  # the code-interpreter server's stack (tests run it under /usr/bin/python3, as the image does)
  python3-ipykernel python3-jupyter-client python3-tornado python3-matplotlib python3-numpy
  python3-pandas python3-pil python3-pexpect nodejs
  # the headless browser tests drive (Playwright with executable_path=/usr/bin/chromium)
  chromium
)
if [[ -n "${DSEC_EXTRA_APT:-}" ]]; then
  # shellcheck disable=SC2206
  APT_PACKAGES+=(${DSEC_EXTRA_APT})
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bootstrap: need root to apt-get install: ${missing[*]}" >&2
    exit 1
  fi
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dsec-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp || constraints.txt -nt $stamp ]]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c constraints.txt -e '.[dev,server,cluster,integrations]'
  touch "$stamp"
fi

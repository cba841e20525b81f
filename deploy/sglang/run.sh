#!/usr/bin/env bash
# A real SGLang 0.5.23 server on CPU with kvsidecar watching it, in one command: the server
# (tiny Llama config, dummy weights, no tokenizer) with kvsidecar's plugin loaded from its
# sglang.srt.plugins entry point (nothing on its command line), and `kvsidecar serve` on its
# segment. Needs only the SGLang engine env: `bash .ci/engine-env sglang` (shared by the clones
# on the host, it runs the kvsidecar of the clone whose run.sh starts it). The server's flags
# and the test-only sgl_kernel stand-in are the tests' (kvsidecar/bench/sglang.py); the exact
# command is the first line of <workdir>/sglang.log.
# Ctrl-C (or SIGTERM) stops everything and removes the segment.
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() {
  cat <<'EOF'
usage: bash deploy/sglang/run.sh [options]
  --port N            SGLang's HTTP server: /generate, /metrics (default 30000)
  --metrics-port N    kvsidecar serve: /metrics from the segment (default 19440)
  --workdir DIR       logs, model config, pid files (default: a new temporary directory)
  --timeout S         how long to wait for the server (default 600)
EOF
}

port=30000 metrics_port=19440 workdir="" timeout=600
. deploy/lib/sessions.sh
parse_options "--port=port --metrics-port=metrics_port --workdir=workdir --timeout=timeout" "$@"

REPO=$(pwd)
env=.engine-envs/sglang
py=$env/bin/python
[ -x "$py" ] || { echo "run.sh: no SGLang env at $py: build it with \`bash .ci/engine-env sglang\`" >&2; exit 2; }
# bin/kvsidecar comes with the env's shim (kvsidecar/bench/engine_envs.py); an env built
# before it had none.
[ -x "$env/bin/kvsidecar" ] \
  || { echo "run.sh: $env predates its bin/kvsidecar: rebuild it with \`bash .ci/engine-env sglang\`" >&2; exit 2; }

workdir=${workdir:-$(mktemp -d "${TMPDIR:-/tmp}/kvsidecar-sglang.XXXXXX")}
mkdir -p "$workdir"
workdir=$(cd "$workdir" && pwd)
# The engine's segment: a private tmpfs directory, removed on exit.
shm=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/kvsidecar-sglang.XXXXXX")

pids=() names=()
# SGLang's own shared memory (sglang_loads_*.shm), which it unlinks only when every process
# exits cleanly, and its stop SIGKILLs the scheduler: the files our processes hold now.
engine_shm() {
  local pid p
  for pid in "${pids[@]}"; do
    for p in $(pgrep -s "$pid" 2>/dev/null); do
      ls -l "/proc/$p/fd" 2>/dev/null | sed -n 's|.* -> \(/dev/shm/sglang_loads_[^ ]*\)$|\1|p'
      sed -n 's|.* \(/dev/shm/sglang_loads_[^ ]*\)$|\1|p' "/proc/$p/maps" 2>/dev/null
    done
  done | sort -u
}
cleanup() {
  trap - INT TERM EXIT
  local left pid
  left=$(engine_shm)
  # The engine first, so the daemon sees its segment close. SIGTERM to each session's
  # leader only: SGLang's launcher then stops its scheduler itself (the segment closes
  # cleanly); a SIGTERM to the whole group reads, to the launcher, as its scheduler
  # crashing (it logs one and SIGKILLs itself 5 s later).
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
    await_stop "$pid" 20
  done
  [ -z "$left" ] || rm -f $left
  rm -rf "$shm"
  echo "run.sh: stopped; logs in $workdir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start sglang "$REPO/$py" -m kvsidecar.bench.sglang --workdir "$workdir" --shm-dir "$shm" --port "$port"
start serve "$REPO/$env/bin/kvsidecar" serve --shm-dir "$shm" \
  --web.listen-address "127.0.0.1:$metrics_port" --poll-interval 0.1

echo "run.sh: starting SGLang :$port (logs in $workdir; 1-2 min on 2 cores)"
deadline=$((SECONDS + timeout))
wait_healthy "sglang:$port/health"
wait_healthy "serve:$metrics_port/-/healthy"

echo "run.sh: ready"
echo "  generate     curl -s 127.0.0.1:$port/generate -H 'Content-Type: application/json' -d '{\"input_ids\":[11,12,13,14],\"sampling_params\":{\"max_new_tokens\":8}}'"
echo "               (no tokenizer: the answer is output_ids; meta_info.completion_tokens is the check)"
echo "  kvsidecar    http://127.0.0.1:$metrics_port/metrics (engine=\"sglang\")"
echo "  SGLang       http://127.0.0.1:$port/metrics"
echo "  watch        $REPO/$env/bin/kvsidecar dump --shm-dir $shm --watch"
echo "  Ctrl-C stops everything."
while kill -0 "$(cat "$workdir/sglang.pid")" 2>/dev/null; do sleep 1; done
echo "run.sh: SGLang exited (see $workdir/sglang.log)" >&2
exit 1

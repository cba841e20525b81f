# Sourced by deploy/vllm-pd/run.sh and deploy/sglang/run.sh: their option parser, each process
# of a stack in a session of its own, and the wait for their health endpoints.
# The caller sets: workdir (logs and pid files), py (a Python for the HTTP probe), timeout,
# deadline (in $SECONDS), and the arrays pids and names (empty: start fills them).

# parse_options "--flag=variable ..." "$@": each --flag's value into its variable; -h/--help
# runs the caller's usage.
parse_options() {
  local spec=" ${1//$'\n'/ } " var
  shift
  while [ $# -gt 0 ]; do
    case $1 in -h | --help) usage; exit 0 ;; esac
    case $spec in
      *" $1="*) ;;
      *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    [ $# -ge 2 ] || { echo "run.sh: $1 needs a value (see --help)" >&2; exit 2; }
    var=${spec#*" $1="}
    printf -v "${var%% *}" '%s' "$2"
    shift 2
  done
}

# One session (= process group) each, so a stop reaches every process of it. Each runs in the
# work directory: a checkout's stale *.egg-info on sys.path[0] would hide the installed
# plugin's entry point from the engine.
start() {  # name, then the command; its pid (= its process group) goes to $workdir/name.pid
  local name=$1
  shift
  (cd "$workdir" && exec setsid "$@" >"$workdir/$name.log" 2>&1 </dev/null) &
  pids+=($!)
  names+=("$name")
  echo $! >"$workdir/$name.pid"
}

healthy() {
  "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" \
    2>/dev/null
}

wait_healthy() {  # name:port/path: until it answers; exits 1 when any started process exits
  local name=${1%%:*} other
  until healthy "http://127.0.0.1:${1#*:}"; do
    for other in "${names[@]}"; do
      if ! kill -0 "$(cat "$workdir/$other.pid")" 2>/dev/null; then
        echo "run.sh: $other exited; the end of $workdir/$other.log:" >&2
        tail -n 20 "$workdir/$other.log" >&2
        exit 1
      fi
    done
    if [ $SECONDS -ge "$deadline" ]; then
      echo "run.sh: $name not healthy in $timeout s (see $workdir/$name.log; raise --timeout)" >&2
      exit 1
    fi
    sleep 1
  done
}

# await_stop pid seconds: wait for a session leader to exit, then SIGKILL its whole group.
# The wait is timed by $SECONDS, not by a count of sleeps: on a loaded host each `sleep`
# costs a fork and exec, and a counted wait ran far past its nominal length (CI).
await_stop() {
  local end=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
  if kill -0 "$1" 2>/dev/null; then
    echo "run.sh: pid $1 still running $2 s after SIGTERM: killing its process group" >&2
  fi
  kill -KILL -- "-$1" 2>/dev/null || true
}

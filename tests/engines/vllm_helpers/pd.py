"""Test side of the real P/D pair (tests/engines/test_vllm_pd.py), run in the test's Python:
start deploy/vllm-pd/run.sh as documented, read both sides' series, record a series over
time, and evaluate the repository's alert rule on recorded samples with promtool."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from tests.deploy.support import find_tool
from tests.engines.envs import ROOT

RUN_SH = ROOT / "deploy" / "vllm-pd" / "run.sh"
RULES = ROOT / "deploy" / "prometheus" / "kvsidecar-rules.yml"
ALERT = "KvsidecarKVTransferNotCompleting"
VLLM = {"model_name": "tiny", "engine": "0"}


def promtool() -> str:
    """promtool, or skip with the fix (fail under KVSIDECAR_REQUIRE_ENGINES: CI has it)."""
    path = find_tool("promtool")
    if path is not None:
        return path
    reason = "promtool is not installed (Debian/Ubuntu: apt-get install prometheus)"
    if os.environ.get("KVSIDECAR_REQUIRE_ENGINES", "") not in ("", "0"):
        pytest.fail(f"{reason}; KVSIDECAR_REQUIRE_ENGINES is set: CI must not skip this")
    pytest.skip(reason)


def load_proxy() -> Any:
    """deploy/vllm-pd/proxy.py as a module (its folder is not a package)."""
    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "deploy/vllm-pd/proxy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_ports(count: int, consecutive: bool = False) -> list[int]:
    """Free ports below the kernel's ephemeral range (`fleet.free_port_run`): vLLM binds its
    side channel a minute after start, and an ephemeral port picked now may by then carry
    someone's connection."""
    out: list[int] = []
    width = 2 if consecutive else 1
    for _ in range(count):
        base = fleet.free_port_run(width, taken=[p + i for p in out for i in range(width)])
        out.append(base)
    return out


class Pair:
    """deploy/vllm-pd/run.sh started as a user would (its own session), with free ports."""

    def __init__(self, workdir: Path, lease_s: float, timeout: float) -> None:
        self.workdir = workdir
        names = ("proxy", "prefill", "decode", "metrics")
        self.ports = dict(zip(names, _free_ports(len(names))))
        (side,) = _free_ports(1, consecutive=True)
        cmd = ["bash", str(RUN_SH), "--lease", str(int(lease_s)), "--workdir", str(workdir)]
        cmd += ["--side-port", str(side), "--timeout", str(int(timeout))]
        for k, v in self.ports.items():
            cmd += [f"--{k}-port", str(v)]
        self.log = open(workdir / "run.sh.out", "w+")
        env = {**os.environ}
        env.pop("VIRTUAL_ENV", None)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        while time.monotonic() - t0 < timeout + 30:
            out = Path(self.log.name).read_text()
            if "run.sh: ready" in out:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"run.sh exited {self.proc.returncode}:\n{out[-4000:]}")
            time.sleep(1)
        else:
            self.stop()
            raise RuntimeError(f"run.sh not ready in {timeout} s:\n{out[-4000:]}")
        self.startup_s = time.monotonic() - t0
        self.kvs = f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def pid(self, name: str) -> int:
        return int((self.workdir / f"{name}.pid").read_text())

    def vllm(self, side: str) -> dict:
        return vb.scrape(f"http://127.0.0.1:{self.ports[side]}/metrics")

    def vllm_value(self, side: str, name: str) -> float:
        """A vLLM series of one side; 0 for a counter vLLM has not created yet."""
        try:
            return vb.value(self.vllm(side), name, **VLLM)
        except KeyError:
            if name.endswith(("_total", "_count")):
                return 0.0
            raise

    def kv(self, role: str, field: str, metrics: dict | None = None) -> float:
        m = metrics if metrics is not None else vb.scrape(self.kvs)
        name = field if field.startswith("kvsidecar_") else f"kvsidecar_kv_pool_{field}"
        labels = {"role": role}
        if name.startswith("kvsidecar_kv_pool_"):
            labels["pool"] = "block_pool"
        return vb.value(m, name, **labels)

    def healthy(self, side: str) -> bool:
        try:
            with vb.urllib.request.urlopen(
                f"http://127.0.0.1:{self.ports[side]}/health", timeout=10
            ) as r:
                return r.status == 200
        except OSError:
            return False

    def log_text(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def processes(self, name: str) -> dict[str, list[str]]:
        """Every live process of one server's process group: pid -> its /proc stat fields
        from field 3 (state) on, after pid and (comm)."""
        pgid, out = self.pid(name), {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:  # field 5 (pgrp)
                out[entry] = fields
        return out

    def cpu_seconds(self, name: str) -> float:
        """CPU time (user + system) of every live process of one server's process group."""
        tick = os.sysconf("SC_CLK_TCK")
        return sum(
            (int(f[11]) + int(f[12])) / tick for f in self.processes(name).values()
        )  # utime, stime

    def kill(self, name: str) -> None:
        """SIGKILL one server's whole process group (API server and engine core)."""
        os.killpg(self.pid(name), signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # run.sh's trap stops its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class Recorder:
    """Samples a function every `period` seconds in a thread: [(monotonic time, value)]."""

    def __init__(self, fn: Any, period: float = 0.25) -> None:
        self.fn, self.period = fn, period
        self.samples: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.fn()))
            except Exception as e:  # a failed scrape is a gap, like Prometheus's
                self.samples.append((time.monotonic(), e))
            self._stop.wait(self.period)

    def last(self) -> Any:
        """The latest value that is not a failed sample (None before any)."""
        for _, v in reversed(self.samples):
            if not isinstance(v, Exception):
                return v
        return None

    def stop(self) -> list[tuple[float, Any]]:
        self._stop.set()
        self._thread.join(30)
        return self.samples


def on_grid(samples: list[tuple[float, float]], step: float) -> list[float | None]:
    """Resample to a regular grid from the first sample: at each point the latest sample at
    or before it (what Prometheus's instant lookup returns), None before any."""
    if not samples:
        return []
    t0, end = samples[0][0], samples[-1][0]
    out: list[float | None] = []
    i, last = 0, None
    t = t0
    while t <= end + 1e-9:
        while i < len(samples) and samples[i][0] <= t + 1e-9:
            last = samples[i][1]
            i += 1
        out.append(last)
        t += step
    return out


def templated_rule(threshold_s: float, for_s: int) -> dict:
    """The repository's KvsidecarKVTransferNotCompleting rule with its threshold and `for`
    replaced (a lease of seconds, not the production 300 s / 1m)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == ALERT:
                expr, n = re.subn(r">\s*300\b", f"> {threshold_s:g}", rule["expr"])
                assert n == 1, f"{ALERT}: threshold '> 300' not found in {rule['expr']!r}"
                return {**rule, "expr": expr, "for": f"{for_s}s"}
    raise AssertionError(f"{ALERT} not in {RULES}")


def promtool_alert_times(
    promtool: str,
    tmp: Path,
    series: str,
    values: list[float | None],
    step_s: int,
    threshold_s: float,
    for_s: int,
) -> dict[int, bool]:
    """Evaluate the templated rule with `promtool test rules` on a recorded series at every
    grid point: {index: firing}. One rules test per point, each asserting "firing" and
    promtool saying which failed, so the answer comes from promtool's own evaluation."""
    rule = templated_rule(threshold_s, for_s)
    (tmp / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "pd", "rules": [rule]}]}))
    text = " ".join("_" if v is None else f"{v:.3f}" for v in values)
    firing: dict[int, bool] = {}
    for i in range(len(values)):
        test = {
            "rule_files": ["rules.yml"],
            "evaluation_interval": f"{step_s}s",
            "tests": [
                {
                    "interval": f"{step_s}s",
                    "input_series": [{"series": series, "values": text}],
                    "alert_rule_test": [
                        {
                            "eval_time": f"{i * step_s}s",
                            "alertname": ALERT,
                            "exp_alerts": [],
                        }
                    ],
                }
            ],
        }
        (tmp / "test.yml").write_text(yaml.safe_dump(test))
        proc = subprocess.run(
            [promtool, "test", "rules", "test.yml"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=60,
        )
        out = proc.stdout + proc.stderr
        if proc.returncode == 0:
            firing[i] = False
        else:
            assert "alertname: " + ALERT in out and "got:" in out, out
            firing[i] = True
    return firing


def server_cores(pair: Pair, side: str) -> dict[str, set[int]]:
    """The cores each thread of one server may run on ("pid/tid" -> cores), from /proc."""
    out: dict[str, set[int]] = {}
    for pid in pair.processes(side):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                (line,) = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list:")]
                out[f"{pid}/{tid}"] = _cpu_list(line.split(":", 1)[1].strip())
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread or process that ended while it was read
    return out


def _cpu_list(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores

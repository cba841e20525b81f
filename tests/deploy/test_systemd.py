"""deploy/systemd: the unit verifies cleanly and is hardened (exposure <= 2.0)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .support import DEPLOY, SERVE_FLAGS, env_twin, require_tool, run, serve_env_twins

UNIT = DEPLOY / "systemd" / "kvsidecar.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "kvsidecar.env.example"
MAX_EXPOSURE = 2.0


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """[Section] -> key -> every value (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"key outside a section: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture
def runnable_unit(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart binary exists on this machine.

    `systemd-analyze verify` fails when the ExecStart binary is missing, and
    /usr/local/bin/kvsidecar is not installed on a test machine.
    """
    text = UNIT.read_text()
    text, n = re.subn(r"(?m)^ExecStart=/usr/local/bin/kvsidecar\b", "ExecStart=/bin/true", text)
    assert n == 1, "ExecStart=/usr/local/bin/kvsidecar ... not found in the unit"
    out = tmp_path / "kvsidecar.service"
    out.write_text(text)
    return out


# Messages about the host rather than the unit (its User=/Group= need not
# exist on a test machine).
BENIGN = [
    re.compile(r"(user|group)\b.*\b(does not exist|not found|unknown)", re.I),
]


def verify_problems(unit: Path) -> tuple[int, list[str]]:
    tool = require_tool("systemd-analyze", "systemd is required")
    proc = run([tool, "verify", "--man=no", str(unit)])
    lines = (proc.stdout + proc.stderr).splitlines()
    # verify also loads the unit's dependencies; only our unit's lines count,
    # and it reports unknown keys and bad values as warnings with exit code 0.
    ours = [ln for ln in lines if unit.name in ln or str(unit.parent) in ln]
    problems = [ln for ln in ours if not any(p.search(ln) for p in BENIGN)]
    return proc.returncode, problems


def test_unit_verifies(runnable_unit: Path) -> None:
    rc, problems = verify_problems(runnable_unit)
    assert rc == 0 and not problems, "\n".join(problems) or f"systemd-analyze verify exited {rc}"


def test_verify_check_catches_mistakes(runnable_unit: Path) -> None:
    """The check above is strict: a misspelled key or bad value fails it."""
    text = runnable_unit.read_text()
    runnable_unit.write_text(
        text.replace("ProtectHome=yes", "ProtectHomee=yes").replace("UMask=0077", "UMask=x")
    )
    _, problems = verify_problems(runnable_unit)
    assert any("ProtectHomee" in p for p in problems)
    assert any("UMask" in p or "mode" in p for p in problems)


def test_security_exposure(runnable_unit: Path) -> None:
    tool = require_tool("systemd-analyze", "systemd is required")
    proc = run([tool, "security", "--offline=true", "--no-pager", str(runnable_unit)])
    out = proc.stdout + proc.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out)
    assert m, f"no exposure level in systemd-analyze output:\n{out}"
    exposure = float(m.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{out}"
    # --threshold is in tenths (exposure 1.4 passes 14): cross-check the parse.
    gate = run(
        [
            tool,
            "security",
            "--offline=true",
            "--no-pager",
            f"--threshold={round(MAX_EXPOSURE * 10)}",
            str(runnable_unit),
        ]
    )
    assert gate.returncode == 0, gate.stdout + gate.stderr


def test_unit_settings() -> None:
    text = UNIT.read_text()
    unit = parse_unit(text)
    svc = unit["Service"]

    def one(key: str) -> str:
        assert key in svc, f"{key}= missing"
        return svc[key][-1]

    # Settings that would delete or hide the engine's segments.
    for key in ("RemoveIPC", "DynamicUser", "PrivateUsers"):
        for value in svc.get(key, []):
            assert value.lower() in {"no", "false", "0", "off"}, f"{key}= must not be enabled"
    assert "RemoveIPC" in text and "DynamicUser" in text, (
        "comment explaining RemoveIPC/DynamicUser missing"
    )
    assert one("ExecStart").split()[:2] == ["/usr/local/bin/kvsidecar", "serve"]
    assert one("EnvironmentFile").lstrip("-").startswith("/etc/")
    assert one("User") not in {"root", "0", ""}
    assert one("Group"), "Group= (the engine's group) missing"
    assert one("ProtectSystem") == "strict"
    assert "/dev/shm" in " ".join(svc["ReadOnlyPaths"]).split()
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "MemoryDenyWriteExecute",
        "RestrictSUIDSGID",
        "LockPersonality",
        "RestrictRealtime",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectControlGroups",
    ):
        assert one(key) in {"yes", "true"}, key
    assert one("CapabilityBoundingSet") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert svc.get("SystemCallFilter"), "SystemCallFilter= missing"


def test_env_example_names_are_flag_twins() -> None:
    twins, from_code = serve_env_twins()
    if from_code:  # the contract's flags must all still be there
        assert {env_twin(f) for f in SERVE_FLAGS} <= twins
    names = set(re.findall(r"(?m)^#?\s*(KVSIDECAR_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text()))
    assert names, "no KVSIDECAR_* variables in the env example"
    assert names <= twins, f"unknown variables: {sorted(names - twins)}"
    assert twins <= names, f"flags without an example: {sorted(twins - names)}"


def test_socket_unit_verifies_and_holds_the_default_port(runnable_unit: Path) -> None:
    """kvsidecar.socket (socket activation, --web.systemd-socket): beside the service it
    starts, it verifies cleanly and holds the port serve would bind."""
    from kvsidecar.settings import DEFAULT_PORT

    socket_unit = runnable_unit.with_name("kvsidecar.socket")
    socket_unit.write_text((DEPLOY / "systemd" / "kvsidecar.socket").read_text())
    rc, problems = verify_problems(socket_unit)
    assert rc == 0 and not problems, "\n".join(problems) or f"verify exited {rc}"
    sections = parse_unit(socket_unit.read_text())
    assert sections["Socket"]["ListenStream"] == [str(DEFAULT_PORT)]
    assert sections["Install"]["WantedBy"] == ["sockets.target"]

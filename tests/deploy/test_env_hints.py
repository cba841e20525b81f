"""The systemd env file's hints name paths that exist in the layout the daemon reads
(issue 33 item 3: `ls -ln /dev/shm/kvsidecar.*` matched nothing, the segments live
inside /dev/shm/kvsidecar/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvsidecar.protocol.names import DEFAULT_SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
ENV_EXAMPLE = ROOT / "deploy" / "systemd" / "kvsidecar.env.example"


def _ls_hints() -> list[str]:
    return re.findall(r"`(ls [^`]*)`", ENV_EXAMPLE.read_text())


def test_owner_hint_lists_the_segment_directory(tmp_path: Path) -> None:
    hints = _ls_hints()
    assert hints, "the ALLOW_UID hint lost its ls command"
    for hint in hints:
        paths = [a for a in hint.split()[1:] if not a.startswith("-")]
        assert paths, hint
        for path in paths:
            inside = path.startswith(DEFAULT_SHM_DIR + "/")
            assert path.rstrip("/") == DEFAULT_SHM_DIR or inside, hint
            # Run it against a stand-in of the layout: a segment inside the directory.
            fake = tmp_path / Path(DEFAULT_SHM_DIR).name
            fake.mkdir(exist_ok=True)
            (fake / "kvsidecar.engine.1.rank0").write_bytes(b"")
            local = path.replace(DEFAULT_SHM_DIR, str(fake))
            r = subprocess.run(
                ["bash", "-c", f"ls -ln {local}"], capture_output=True, text=True, timeout=30
            )
            assert r.returncode == 0 and "kvsidecar.engine.1.rank0" in r.stdout, (hint, r)

"""A web config swapped for something that is not a bounded regular file (issue 24 item
5): on cb621d7 a FIFO blocked the HTTP server on open (health probe included), a SIGHUP
then left SIGTERM unanswered for over 10 s, and /dev/zero read until MemoryError. The
real ``kvsidecar serve``; ~10 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvsidecar.bench.fleet import start_daemon, stop_daemon
from kvsidecar.web.config import WebConfigError
from kvsidecar.web.config_file import load_web_config
from tests.attacks.hostile_clients import _probe


def swap(web: Path, how: str) -> None:
    web.unlink()
    if how == "fifo":
        os.mkfifo(web)
    else:
        web.symlink_to("/dev/zero")


@pytest.mark.parametrize("how", ["fifo", "/dev/zero"])
def test_a_swapped_web_config_never_stops_the_server(
    shm_dir: str, tmp_path: Path, how: str
) -> None:
    web = tmp_path / "web.yml"
    web.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    daemon, url = start_daemon(shm_dir, "--web.config.file", str(web), wait_for_source=False)
    port = int(url.rsplit(":", 1)[1])
    try:
        swap(web, how)
        time.sleep(1.5)  # past the 1 s change check
        # Probes are answered within the kubelet's 2 s (each would hang forever on cb621d7).
        answered = [_probe(port, "/-/healthy", None, timeout=2.0)[0] for _ in range(5)]
        assert all(answered), answered
        daemon.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert _probe(port, "/-/healthy", None, timeout=2.0)[0], "answered after SIGHUP"
        daemon.send_signal(signal.SIGTERM)
        # Generous: a loaded host stops it in well under a second; cb621d7 took > 10 s.
        assert daemon.wait(8) == 0, "SIGTERM is obeyed after the SIGHUP"  # wait() bounds it
    finally:
        stop_daemon(daemon)


@pytest.mark.parametrize("how", ["fifo", "/dev/zero"])
def test_loading_refuses_what_is_not_a_regular_file(tmp_path: Path, how: str) -> None:
    web = tmp_path / "web.yml"
    web.write_text("")
    swap(web, how)
    with pytest.raises(WebConfigError, match="not a regular file"):
        load_web_config(web)


def test_an_oversized_config_is_refused(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("#" * (2 * 1024 * 1024))
    with pytest.raises(WebConfigError, match="more than"):
        load_web_config(web)

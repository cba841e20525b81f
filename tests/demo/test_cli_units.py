"""`kvsidecar demo` pieces that need no engine: addresses, port fallback, no torch import."""

from __future__ import annotations

import socket
import subprocess
import sys

import click
import pytest

from kvsidecar.cli.demo import port_free, split_address, url_host
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)


def test_split_address() -> None:
    assert split_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert split_address(":9400") == ("", 9400)
    assert split_address("[::1]:9400") == ("::1", 9400)
    with pytest.raises(click.BadParameter):
        split_address("localhost")
    # One parser for serve and demo: what the daemon rejects, the demo rejects too.
    from kvsidecar.web.listen_address import parse_listen_address

    for bad in ("::1:9400", "[::1]9400", ":70000", "host:http", "[::1"):
        with pytest.raises(ValueError):
            parse_listen_address(bad)
        with pytest.raises(click.BadParameter):
            split_address(bad)
    assert url_host("") == "localhost" and url_host("::1") == "[::1]"


def test_port_in_use_is_detected() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_free("127.0.0.1", port)
    assert port_free("127.0.0.1", port)


def test_cli_and_pd_launcher_do_not_import_torch() -> None:
    code = (
        "import sys, kvsidecar.cli.main, kvsidecar.cli.demo, kvsidecar.agent.demo.launch, "
        "kvsidecar.agent.demo.plot; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)

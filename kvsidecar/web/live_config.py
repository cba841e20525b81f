"""The web config in force: re-read when its files change or on SIGHUP, TLS context,
basic auth and rate-limit bucket kept across reloads that don't change them."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsidecar.web.basic_auth import BasicAuth
from kvsidecar.web.config import RateLimitConfig, WebConfig, WebConfigError
from kvsidecar.web.config_file import load_web_config
from kvsidecar.web.tls_context import build_ssl_context

log = logging.getLogger(__name__)

__all__ = ["LiveConfig", "LiveState", "TokenBucket"]


class TokenBucket:
    """exporter-toolkit's ``rate_limit``: one token per interval, up to ``burst``."""

    def __init__(self, cfg: RateLimitConfig) -> None:
        self.cfg = cfg
        self._tokens = float(cfg.burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            refill = (now - self._last) / self.cfg.interval_s
            self._tokens = min(float(self.cfg.burst), self._tokens + refill)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


@dataclass(frozen=True)
class LiveState:
    cfg: WebConfig | None
    ssl_context: ssl.SSLContext | None
    auth: BasicAuth
    bucket: TokenBucket | None

    @classmethod
    def build(cls, cfg: WebConfig | None, previous: LiveState | None = None) -> LiveState:
        if cfg is None:
            return cls(None, None, BasicAuth({}), None)
        ctx = build_ssl_context(cfg.tls) if cfg.tls is not None else None
        users = dict(cfg.basic_auth_users)
        # Keep the bcrypt cache and the token bucket across reloads that don't change them.
        if previous is not None and previous.auth.users == users:
            auth = previous.auth
        else:
            auth = BasicAuth(users)
        bucket = None
        if cfg.rate_limit is not None:
            old = previous.bucket if previous is not None else None
            bucket = (
                old
                if old is not None and old.cfg == cfg.rate_limit
                else TokenBucket(cfg.rate_limit)
            )
        return cls(cfg, ctx, auth, bucket)


def _stamp(paths: Sequence[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)  # follows symlinks: Kubernetes swaps a ..data symlink on update
            out.append((p, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((p, None))
    return tuple(out)


class LiveConfig:
    """The current web config. Like exporter-toolkit, the file is re-read when it or a
    certificate changes, so rotated certificates and users apply without a restart;
    a broken new version is logged and the last good one stays in force."""

    def __init__(
        self,
        cfg: WebConfig | None,
        check_interval_s: float,
        check: Callable[[WebConfig], None] | None = None,
    ) -> None:
        # `check`: what a reloaded config must also pass (raises WebConfigError), as the
        # first one did (the gateway's file: kvsidecar/web/poll_tls.py).
        self._extra_check = check
        self._state = LiveState.build(cfg)
        self._interval = check_interval_s
        self._stamp = _stamp(cfg.files) if cfg is not None and cfg.path else None
        self._next = time.monotonic() + check_interval_s
        self._lock = threading.Lock()

    def current(self) -> LiveState:
        if self._stamp is None or time.monotonic() < self._next:
            return self._state
        # Called on the event loop: never wait for a reload in progress (SIGHUP's).
        if not self._lock.acquire(blocking=False):
            return self._state
        try:
            return self._check_locked(force=False)
        finally:
            self._lock.release()

    def peek(self) -> LiveState:
        """The state in force, without looking at the file (for threads other than the
        front's: one thread re-reads it, so a half-written file is seen at most once)."""
        return self._state

    def reload(self) -> bool:
        """Re-read the file now, changed or not (SIGHUP); False if it was invalid."""
        if self._stamp is None:
            log.info("reload requested; no --web.config.file to reload")
            return True
        before = self._state
        state = self._check(force=True)
        return state is not before

    def _check(self, force: bool) -> LiveState:
        with self._lock:
            return self._check_locked(force)

    def _check_locked(self, force: bool) -> LiveState:
        """The caller holds the lock."""
        if not force and time.monotonic() < self._next:
            return self._state
        self._next = time.monotonic() + self._interval
        old = self._state
        assert old.cfg is not None and old.cfg.path is not None
        stamp = _stamp(old.cfg.files)
        if stamp == self._stamp and not force:
            return old
        self._stamp = stamp  # don't retry a broken file until it changes again
        try:
            cfg = load_web_config(old.cfg.path)
            if (cfg.tls is None) != (old.cfg.tls is None):
                raise WebConfigError(f"{cfg.path}: TLS can only be turned on or off with a restart")
            if self._extra_check is not None:
                self._extra_check(cfg)
            self._state = LiveState.build(cfg, previous=old)
            self._stamp = _stamp(cfg.files)
        except (WebConfigError, OSError) as e:
            log.error("web config changed but is invalid, keeping the previous one: %s", e)
            return old
        log.info("reloaded web config %s", cfg.path)
        return self._state

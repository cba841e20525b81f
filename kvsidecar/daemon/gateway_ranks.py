"""What a gateway listener would answer for each DP rank, judged from the segments alone
(`kvsidecar ls`, no daemon needed): a rank two live segments claim is **ambiguous** and a rank
none of whose segments is up is **down**; the gateway answers both 503 (kvsidecar/daemon/
gateway.py: outcomes ``ambiguous`` and ``not_up``). The verdict is the gateway's own rule: the
segments' latest identity (dp_rank, role), live meaning up.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsidecar.daemon.target import TargetView
from kvsidecar.printable import printable

__all__ = ["rank_problems"]


def rank_problems(views: Iterable[TargetView]) -> list[str]:
    """One line per ambiguous or down rank, in rank order; empty when every rank is served."""
    by_rank: dict[int, list[TargetView]] = {}
    for v in views:
        if v.last is not None:
            by_rank.setdefault(v.last.snapshot.runtime.dp_rank, []).append(v)
    lines = []
    for rank, claimants in sorted(by_rank.items()):
        up = [v for v in claimants if v.up]
        names = ", ".join(printable(v.name) for v in (up or claimants))
        if len(up) > 1:
            roles = sorted({v.last.snapshot.runtime.role for v in up if v.last is not None})
            fix = (
                f"pass --gateway.role ({' or '.join(roles)})"
                if len(roles) == len(up)
                else "run one engine instance per pod"
            )
            lines.append(
                f"dp_rank {rank}: ambiguous: {len(up)} live segments claim it ({names}); "
                f"a gateway answers 503 unless told which: {fix}"
            )
        elif not up:
            states = ", ".join(sorted({v.state for v in claimants}))
            lines.append(f"dp_rank {rank}: down: {names} {states}; a gateway answers 503 for it")
    return lines

"""Our SGLang identity against SGLang 0.5.23's real ``ServerArgs`` (resolved as its launcher
resolves them, ``resolve_once``, and published as in its processes) and SGLang's own metric
labels (``tokenizer_metric_labels``): the ``model_name`` we publish is the one SGLang's
series carry, with and without ``--served-model-name``. No server, no model weights (the
config of a tiny model). Run by tests/engines/test_sglang_real.py:

    python identity.py SHM_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_helpers"))

from common import write_model  # the tiny model's config.json (pure Python)


def main() -> int:
    from sglang.version import __version__

    with tempfile.TemporaryDirectory(prefix="kvsidecar-sglang-model-") as d:
        cases = identities(write_model(d))
    print(json.dumps({"sglang": __version__, "cases": cases}))
    return 0


def identities(model: str) -> list[dict]:
    from sglang.srt.observability.metrics_collector import tokenizer_metric_labels
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from kvsidecar.agent.engines.sglang import _identity

    cases = []
    for name, kw in (
        ("no --served-model-name", {}),
        ("--served-model-name", {"served_model_name": "served-llama"}),
        ("--device cpu:0", {"device": "cpu:0"}),
    ):
        args = ServerArgs(model_path=model, **{"device": "cpu", **kw})
        args.resolve_once()
        get_context().set_server_args(args)  # what each SGLang process does at start
        ours = _identity(SimpleNamespace(server_args=args, tp_rank=0, pp_rank=0, dp_rank=0))
        cases.append(
            {
                "case": name,
                "raw_served_model_name": args.served_model_name,
                "sglang_label": tokenizer_metric_labels()["model_name"],
                "ours": ours["model_name"],
                "model_path": model,
                "raw_device": args.device,
                "sglang_device": args.resolved_dict()["device"],
                "our_device": ours["device"],
            }
        )
    return cases


if __name__ == "__main__":
    sys.exit(main())

"""Version tolerance against the real vLLM: with a hook point removed (as an older or newer
vLLM might lack it) the plugin disables itself with one log line naming the version and the
attribute (through vLLM's own logging: the test reads it from the output), and the engine
generates as usual; with KVSIDECAR_DISABLE=1 register() patches nothing. Prints one RESULT
JSON line. Run inside the vLLM env."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import engine_env, llm_kwargs, write_model


def main() -> int:
    model_dir, shm = sys.argv[1], sys.argv[2]
    os.environ.update(engine_env())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["KVSIDECAR_SHM_DIR"] = shm

    from vllm.config.scheduler import SchedulerConfig

    from kvsidecar.agent.engines import vllm as plugin

    # KVSIDECAR_DISABLE=1: nothing is patched.
    before = SchedulerConfig.get_scheduler_cls
    os.environ["KVSIDECAR_DISABLE"] = "1"
    plugin.register()
    disabled_patched = SchedulerConfig.get_scheduler_cls is not before
    del os.environ["KVSIDECAR_DISABLE"]

    from vllm import LLM, SamplingParams
    from vllm.v1.core.block_pool import BlockPool

    del BlockPool.unpin_blocks  # a hook point this vLLM "does not have"
    llm = LLM(**llm_kwargs(write_model(model_dir), num_gpu_blocks_override=64))
    outs = llm.generate(
        [{"prompt_token_ids": list(range(5, 45))}],
        SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False),
    )
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    result = {
        "disabled_patched": disabled_patched,
        "generated": len(outs[0].outputs[0].token_ids),
        "sidecar": getattr(sched, "_kvsidecar", None) is not None,
        "segments": sorted(os.listdir(shm)),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

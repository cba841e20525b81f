"""Build the C extensions: seqlock fences, slot publish and guarded slot copy (required);
the gateway listener's fast path and a gateway rank's new-step answer (optional: without a
compiler for them, or where they fail to build, `kvsidecar.web.poll_server` serves every
poll in Python, and a new step takes the full check, as before).

Everything else is in pyproject.toml; setuptools still needs ext_modules here.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsidecar.protocol._seqlock",
            sources=["kvsidecar/protocol/_seqlock.c"],
            depends=["kvsidecar/protocol/_seqlock_api.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
        ),
        Extension(
            "kvsidecar.web._pollfast",
            sources=["kvsidecar/web/_pollfast.c"],
            depends=["kvsidecar/protocol/_seqlock_api.h", "kvsidecar/web/_pollfast_api.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
            optional=True,
        ),
        Extension(
            "kvsidecar.daemon._gatewaystep",
            sources=["kvsidecar/daemon/_gatewaystep.c"],
            depends=["kvsidecar/protocol/_seqlock_api.h", "kvsidecar/web/_pollfast_api.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
            optional=True,
        ),
    ],
    packages=[
        "kvsidecar",
        "kvsidecar.protocol",
        "kvsidecar.cli",
        "kvsidecar.daemon",
        "kvsidecar.web",
        "kvsidecar.otlp",
        "kvsidecar.streams",
        "kvsidecar.bench",
        "kvsidecar.agent",
        "kvsidecar.agent.demo",
        "kvsidecar.agent.bench",
        "kvsidecar.agent.engines",
        "kvsidecar.agent.engines.vllm",
    ],
)

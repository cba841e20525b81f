"""Build the one C extension: seqlock fences, slot publish and guarded slot copy.

Everything else is in pyproject.toml; setuptools still needs ext_modules here.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsidecar.protocol._seqlock",
            sources=["kvsidecar/protocol/_seqlock.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
        )
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

"""The checkout's attack generators and audit benches: hostile writers and neighbours,
floods, slow and idle clients, descriptor exhaustion, costliest conforming targets.

Not in the wheel or the image (vLLM keeps its load generators out of its wheel the same
way). `kvsidecar bench hostile`, `slowloris`, ... run them from a checkout
(`kvsidecar/bench/checkout.py`); the tests import them directly.
"""

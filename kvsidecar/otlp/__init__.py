"""OTLP push (issue 34): optional, needs the ``kvsidecar[otlp]`` extra for the exporter.

Only ``names`` is here so far: the OTel name/unit mapping derived from metric_defs.py,
which needs no OpenTelemetry package.
"""

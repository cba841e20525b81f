"""OTLP push (issue 34): optional, needs the ``kvsidecar[otlp]`` extra for the exporter.

``names`` (the OTel name/unit mapping derived from metric_defs.py) and ``options`` (serve's
flags) need no OpenTelemetry package; ``convert``, ``push`` and ``errors`` load only when
--otlp.endpoint is set.
"""

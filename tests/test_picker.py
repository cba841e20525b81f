"""tests/support/picker.py, the endpoint picker's reading the gateway tests rely on, checked against
prometheus_client's own text parser on generated bodies, and on expfmt's rejections."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import picker

_names = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
_values = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        _names,
        st.tuples(
            st.lists(_names, max_size=3, unique=True),
            st.lists(_values, min_size=3, max_size=3),
            st.floats(allow_nan=False),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_agrees_with_prometheus_client(families):
    registry = CollectorRegistry()
    for name, (labels, values, value) in families.items():
        g = Gauge(name, "help", labels, registry=registry)
        (g.labels(*values[: len(labels)]) if labels else g).set(value)
    text = generate_latest(registry).decode()
    ours = picker.parse(text)
    theirs = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(ours) == set(theirs)
    for name, fam in theirs.items():
        assert ours[name].type == fam.type
        assert ours[name].samples == [(s.labels, s.value) for s in fam.samples]


@pytest.mark.parametrize(
    "body, error",
    [
        ("# TYPE a gauge\n# TYPE a gauge\na 1\n", "second TYPE"),
        ("a 1\n# TYPE a gauge\n", "after samples"),
        ("# HELP a x\n# HELP a y\na 1\n", "second HELP"),
        ("# TYPE a.b gauge\n", "invalid metric name"),
        ('a{b="1",b="2"} 1\n', "duplicate label"),
        ("a one\n", "bad value"),
        ("# TYPE a nonsense\n", "unknown metric type"),
    ],
)
def test_rejects_what_expfmt_rejects(body, error):
    with pytest.raises(picker.ParseError, match=error):
        picker.parse(body)


def test_first_matching_series_wins_and_untyped_reads_zero():
    text = 'a{x="1"} 5\na{x="2"} 7\n# TYPE g gauge\ng{x="1"} 3\ng{x="2"} 4\n'
    fams = picker.parse(text)
    assert picker.value(fams, "a") == 0.0  # untyped
    assert picker.value(fams, "g") == 3.0
    assert picker.value(fams, 'g{x="2"}') == 4.0

"""Arbitrary YAML/JSON fed to the loader gives a config or validation errors, never an exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.loader import load_config_data, load_config_text

FIELDS = ["type", "name", "port", "image", "python", "nvcc", "docker", "privileged", "env", "commands",
          "resources", "replicas", "groups", "scaling", "probes", "model", "auth", "spot_policy", "count",
          "cpu", "gpu", "memory", "disk", "metric", "target", "window", "router", "max_price"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True),
                    st.sampled_from(["service", "0..2", "..3", "1..", "..", "A100:80GB:2", "5m", "3.1", "rps",
                                     "x86:4", "24GB..", "H100,A100:1..2", "K=V", "", "-1"]),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner, max_size=5)),
    max_leaves=30)
documents = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).map(lambda d: {"type": "service", **d})


def _check(result) -> None:
    assert (result.config is None) == bool(result.errors)  # exactly one of: a config, or errors
    for e in result.errors:
        assert isinstance(str(e), str) and e.message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_structured_documents_never_raise(doc):
    _check(load_config_data(doc))
    # The same document as JSON text (which is YAML) goes through the YAML path too.
    _check(load_config_text(json.dumps(doc, default=str)))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text):
    _check(load_config_text(text))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["type: service", "port: 80", "replicas:", "  - count: 1", "    commands: [x]",
                                 "  - name: a", "&a [1]", "*a", "- x", "key: {", "  gpu: A100", "resources:",
                                 "\t", ":", "? x", "!!binary x", "%YAML 1.2", "---", "..."]), max_size=12))
def test_yaml_fragments_never_raise(lines):
    _check(load_config_text("\n".join(lines)))

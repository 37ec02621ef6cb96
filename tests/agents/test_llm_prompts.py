"""Prompt templates render strictly, and carry the task the contract needs."""

from __future__ import annotations

import pytest

from stitch_backend.agents.llm_coder import launch_rule
from stitch_backend.agents.prompts import PromptError, placeholders, render
from stitch_backend.agents.screen import parse_entry

VALUES = {
    "system": {"arch": "sm_90a", "entry": "k"},
    "generate": {"region_name": "g_fused_0", "ops": "- aten.relu.default", "signature": "sig",
                 "launch_rule": "rule", "template_source": "src", "entry": "k"},
    "repair": {"entry": "k", "signature": "sig", "problem": "p", "feedback": "f"},
    "optimise": {"entry": "k", "signature": "sig", "eager_ms": "1.0", "template_ms": "0.5",
                 "candidate_ms": "0.7"},
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_template_renders_with_exactly_its_values(name):
    assert placeholders(name) == set(VALUES[name])
    text = render(name, **VALUES[name])
    assert "$" not in text.replace("$$", "")


@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_missing_value_raises_naming_it(name):
    values = dict(VALUES[name])
    dropped = sorted(values)[0]
    del values[dropped]
    with pytest.raises(PromptError, match=dropped):
        render(name, **values)


def test_an_unknown_value_and_an_unknown_template_raise():
    with pytest.raises(PromptError, match="extra"):
        render("repair", extra="x", **VALUES["repair"])
    with pytest.raises(PromptError, match="no prompt template"):
        render("nope")


def test_generate_carries_ops_source_signature_and_launch_rule(pointwise_region):
    sub, template = pointwise_region
    entry = parse_entry(template.source)
    source_with_dollar = template.source + "// costs $5 ${x}\n"  # values are verbatim
    text = render("generate", region_name=sub.region_name, ops="\n".join(sub.ops),
                  signature=entry.text, launch_rule=launch_rule(template.kernel),
                  template_source=source_with_dollar, entry=entry.name)
    assert "aten.relu.default" in text and template.source in text and "$5 ${x}" in text
    assert 'extern "C" __global__ void __launch_bounds__(256) g_fused_0(' in text
    assert "blockDim = (256, 1, 1)" in text
    system = render("system", arch="sm_90a", entry=entry.name)
    assert "exactly one ```cuda" in system and "g_fused_0" in system

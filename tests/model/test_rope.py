"""The RoPE rule on the ring, read one way from configs, recipes and per-layer-type parameters."""

from __future__ import annotations

from types import SimpleNamespace

from ringft.model.rope import has_rope_scaling, position_dependent_rope, rope_problem, rope_types


def test_one_matching_rule_for_every_shape_of_rope_parameters():
    per_layer = {
        "full_attention": {"rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_type": "default"},
    }
    assert rope_types(per_layer) == ["linear", "default"] and has_rope_scaling(per_layer)
    assert rope_types(SimpleNamespace(rope_parameters={"type": "dynamic"})) == ["dynamic"]  # legacy key
    assert rope_types(SimpleNamespace(rope_parameters=None, rope_scaling={"rope_type": "yarn"})) == ["yarn"]
    assert rope_types(None) == [] and not has_rope_scaling(
        SimpleNamespace(rope_parameters={"rope_type": "default"})
    )
    # transformers' rule: "dynamic" anywhere in the name, or longrope
    for kind, dependent in [("dynamic", True), ("dynamic_ntk", True), ("longrope", True), ("yarn", False)]:
        assert (position_dependent_rope({"rope_type": kind}) == kind) is dependent, kind
    assert position_dependent_rope({"full_attention": {"rope_type": "longrope"}}) == "longrope"


def test_one_refusal_worded_for_each_caller():
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert rope_problem(dynamic, 1) is None and rope_problem({"rope_type": "llama3"}, 4) is None
    recipe = rope_problem(dynamic, 2, "model.rope_scaling rope_type", "parallel.cp_size")
    assert recipe.startswith("model.rope_scaling rope_type 'dynamic' is not exact with parallel.cp_size=2")
    patch = rope_problem(dynamic, 2)
    assert "rope_type='dynamic'" in patch and "cp_size 1" in patch

"""orchestrator/weight_loads.py: LoRA versions are served from one stable path, a link switched atomically."""

import os

from slipstream.orchestrator.weight_loads import point_link, serving_link


def test_the_serving_link_follows_each_version_and_is_replaced_atomically(tmp_path):
    v1, v2 = tmp_path / "weights" / "step_1", tmp_path / "weights" / "step_2"
    for folder, text in ((v1, "one"), (v2, "two")):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(text)
    link = serving_link(tmp_path, "tenant/a b")
    assert link.parent == tmp_path.resolve() / "serving" and link.name == "tenant_a_b"
    point_link(link, v1)
    assert (link / "adapter_config.json").read_text() == "one"
    point_link(link, v2)  # over the existing link: no window without one
    assert (link / "adapter_config.json").read_text() == "two" and os.readlink(link) == str(v2)
    assert sorted(p.name for p in link.parent.iterdir()) == ["tenant_a_b"]  # no temporary left behind

"""``kvasir info`` on a slice says it is one: its source, what it holds, the source's shapes."""

from __future__ import annotations

import json

from kvasir_bus.cli import main
from synth.model import describe_model


def test_info_on_a_slice_names_its_source_holdings_and_shapes(capsys, models, tmp_path):
    source = models("qwen3moe", "f32")
    sl = tmp_path / "part.gguf"
    assert main(["slice", str(source), "--layer", "0", "--experts", "2-5",
                 "--layer", "1", "--experts", "0-0", "-o", str(sl)]) == 0
    capsys.readouterr()
    whole = describe_model(source)

    assert main(["info", "--json", str(sl)]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("architecture", "layers", "experts", "hidden", "expert_ffn", "fingerprint"):
        assert info[key] == whole[key], key  # the source's shapes, never None
    assert info["expert_slab_bytes"] == whole["expert_slab_bytes"]
    assert info["slice"]["source_fingerprint"] == whole["fingerprint"]
    assert info["slice"]["source_name"] == source.name
    assert info["slice"]["holdings"] == ["L0:2-5", "L1:0-0"]  # inclusive, as `kvasir status` prints
    assert info["slice"]["experts_held"] == 5
    assert info["slice"]["expert_bytes"] == 5 * whole["expert_slab_bytes"]

    assert main(["info", str(sl)]) == 0
    out = capsys.readouterr().out
    assert f"slice (format 1) of model {whole['fingerprint']} ({source.name})" in out
    assert "L0:2-5" in out and "5 experts" in out and "inclusive" in out
    assert f"layers        {whole['layers']} in the source" in out
    assert "None" not in out

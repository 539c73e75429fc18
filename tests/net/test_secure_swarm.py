"""A whole swarm under one identity per node: `kvasir up --secure` is bit-identical and pays."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=9)


def test_up_secure_runs_every_role_under_its_own_identity(model, tmp_path):
    creds = tmp_path / "creds"
    proc = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model),
                           "--workers", "2", "--secure", str(creds), "--prompt", "Experts by the swarm",
                           "-n", "6", "--check", "--json", "--timeout-ms", "20000"],  # every call waits for the workers
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["check"]["bit_identical"] and result["check"]["tokens_equal"]
    assert sum(w["calls"] for w in result["workers"].values()) == result["dispatch"]["calls"] > 0
    assert result["dispatch"]["local"] == 0
    paid = {n["node"]: n["rows"] for n in result["rewards"]["nodes"]}
    # Empty totals happened in 2 of many CI runs (and once in a full suite beside benchmarks): the
    # log's tail says whether the market refused the events, held them, or was not asked in time.
    # Printed whole (pytest shows a failed test's output in full; an assertion message it cuts).
    if paid != {name: w["rows"] for name, w in result["workers"].items()}:
        print(proc.stderr[-6000:])
    assert paid == {name: w["rows"] for name, w in result["workers"].items()}, (result["rewards"], proc.stderr[-3000:])
    assert "permissions violation" not in proc.stderr.lower()
    # the JWT deployment of `kvasir creds init`: the server trusts the operator, users are JWTs
    from kvasir_bus import creds as creds_mod, jwt

    dep = creds_mod.load(creds)
    assert dep.auth == "jwt" and {"worker-0", "worker-1"} <= dep.names()
    conf = (creds / "accounts.conf").read_text()
    assert "operator:" in conf and "resolver" in conf and "no_auth_user" not in conf
    assert sorted(p.name for p in creds.glob("*.creds")) == [
        "backbone.creds", "market.creds", "observer.creds", "operator.creds", "worker-0.creds",
        "worker-1.creds"]
    w0 = jwt.decode(jwt.read_creds_jwt(creds / "worker-0.creds"))
    assert w0["name"] == "worker-0" and w0["iss"] == creds_mod.account_public(creds)

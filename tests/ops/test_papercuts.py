"""The papercuts a new user found, each fixed where the user meets it: one line, before the run."""

from __future__ import annotations

import pytest

from kvasir_bus.cli import main
from kvasir_bus.nats_cli import listen_ports
from kvasir_bus.server import EmbeddedNats
from launch.up import served_by


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_kvasir_nats_started_twice_says_the_port_is_taken_in_one_line(capsys, tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text("port: 0\n")
    with EmbeddedNats(port=0) as first:
        err = one_line_error(capsys, ["nats", "--config", str(conf), "--port", str(first.port)])
    assert f"port {first.port}" in err and "taken" in err


def test_listen_ports_reads_the_top_level_of_a_config(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text("host: 0.0.0.0\nport: 4222\nhttp: 127.0.0.1:8222\nwebsocket {\n  port: 8080\n}\n")
    assert listen_ports(conf, None, None) == [("client", "0.0.0.0", 4222), ("monitoring", "127.0.0.1", 8222)]
    assert listen_ports(conf, 5000, 0) == [("client", "0.0.0.0", 5000)]  # 0: any free port, nothing to check


def test_synth_will_not_overwrite_a_file_without_force(capsys, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    err = one_line_error(capsys, ["synth", "-o", str(out)])
    assert "--force" in err and out.read_bytes() == b"precious"


def test_dump_logits_into_a_missing_directory_fails_before_the_run(capsys, tmp_path):
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path / "not-read.gguf"), "--prompt", "x",
                                  "--dump-logits", str(tmp_path / "nope" / "l.npy")])
    assert "does not exist" in err and "nope" in err  # the model was never opened


def test_ctx_outside_the_model_context_is_refused(capsys, models):
    pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
    path = str(models("qwen3moe", "q8_0"))
    assert "--ctx must be 1.." in one_line_error(capsys, ["generate", "--model", path, "--prompt", "x",
                                                          "--ctx", "0"])
    err = one_line_error(capsys, ["generate", "--model", path, "--prompt", "x", "--ctx", "10000000"])
    assert "--ctx must be 1.." in err and "10000000" in err


def test_up_report_lists_every_node_that_served():
    per_node = {"worker-0": {"calls": 5, "rows": 9}, "phone-7": {"calls": 2, "rows": 3}}
    got = served_by(per_node, {"worker-0": "0-3", "worker-1": "4-7"})
    assert list(got) == ["worker-0", "worker-1", "phone-7"]
    assert got["phone-7"] == {"experts": "-", "calls": 2, "rows": 3}
    assert got["worker-1"] == {"experts": "4-7", "calls": 0, "rows": 0}


def test_market_db_in_a_missing_directory_is_refused_naming_it(capsys, tmp_path):
    missing = tmp_path / "no" / "such"
    err = one_line_error(capsys, ["market", "--db", str(missing / "x.db"), "--nats", "nats://127.0.0.1:1"])
    assert f"directory {missing} does not exist" in err and err.startswith("kvasir market: error: --db")
    assert not missing.exists()  # refused, not created
    afile = tmp_path / "afile"
    afile.write_text("")
    err = one_line_error(capsys, ["market", "--db", str(afile / "x.db")])
    assert f"directory {afile} is not a directory" in err


def test_up_refuses_a_market_db_in_a_missing_directory_before_starting(capsys, tmp_path):
    missing = tmp_path / "gone"
    err = one_line_error(capsys, ["up", "--model", str(tmp_path / "not-read.gguf"), "--db", str(missing / "l.db"),
                                  "--prompt", "x"])
    assert f"directory {missing} does not exist" in err and not missing.exists()

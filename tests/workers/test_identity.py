"""A worker's own key (workers/identity.py): the default key slot is kept across starts, workers
running at once on one machine never share one, and the CLI refuses a name that is not its key's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvasir_bus.attribution import is_self_name
from workers import identity


def _release():
    while identity._held:
        os.close(identity._held.pop())


def test_workers_at_once_take_different_slots_and_a_restart_gets_its_name_back(tmp_path):
    try:
        first, path0 = identity.claim_slot(tmp_path)
        second, path1 = identity.claim_slot(tmp_path)  # another worker while the first runs
        assert is_self_name(first.name) and is_self_name(second.name) and first.name != second.name
        assert (path0.name, path1.name) == ("node-0.seed", "node-1.seed")
        assert path0.stat().st_mode & 0o777 == 0o600
        _release()  # both exit
        again, path = identity.claim_slot(tmp_path)
        assert (again.name, path) == (first.name, path0)
    finally:
        _release()


def test_the_default_slot_lives_under_the_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert identity.state_dir() == tmp_path / "kvasir" / "node-keys"


def test_node_key_flag_creates_a_key_file_and_reads_it_back_and_fresh_is_new_each_time(tmp_path):
    path = tmp_path / "me.seed"
    key = identity.from_flag(str(path))
    assert path.exists() and identity.from_flag(str(path)).name == key.name
    assert identity.from_flag("fresh").name != identity.from_flag("fresh").name


def _worker(*flags: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "worker", *flags, "--slice", "/nonexistent.gguf"],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("flags, says", [
    (("--node", "kaaaaaaaaaaaaaaaaaaaaaaaaaa"), "self-certifying name: give its key with --node-key"),
    (("--node", "w1", "--node-key", "{key}"), "is not the name of the key in --node-key"),
    (("--node-key", "{bad}"), "no user nkey seed"),
])
def test_the_cli_refuses_a_name_that_is_not_its_keys_in_one_line(flags, says, tmp_path):
    bad = tmp_path / "bad.seed"
    bad.write_text("not a seed\n")
    flags = [f.format(key=tmp_path / "k.seed", bad=bad) for f in flags]
    out = _worker(*flags)
    assert out.returncode == 2, out
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr

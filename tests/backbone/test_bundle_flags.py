"""``--bundles on|off`` reaches the dispatch on every backbone command that has ``--replicas``."""

import argparse

import pytest

from backbone.cli import add_bus_flags
from backbone.service import BackboneConfig


def parse(*flags):
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_bus_flags(p)
    return BackboneConfig.from_args(p.parse_args(["--model", "m.gguf", *flags]))


def test_bundles_are_on_by_default_and_off_on_request():
    assert parse().dispatch.bundles is True
    assert parse("--bundles", "on").dispatch.bundles is True
    assert parse("--bundles", "off").dispatch.bundles is False


def test_a_bad_bundles_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--bundles", "maybe")
    assert exit_info.value.code == 2 and "--bundles" in capsys.readouterr().err

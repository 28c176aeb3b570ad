"""options.py: one table, one parser; errors name the option and what would be valid."""

from __future__ import annotations

import pytest

from tierstream.errors import ConfigError
from tierstream.options import OPTIONS, parse_options


def test_every_option_has_a_description_a_kind_and_a_scope() -> None:
    for key, option in OPTIONS.items():
        assert option.key == key and option.description and option.kind and option.scopes


def test_values_are_parsed_to_their_types() -> None:
    opts = parse_options({"keyRanges": "4", "maxSplitBytes": "64MiB", "failOnDataLoss": "false",
                          "reconnectTimeout": "90s"}, scope="read")
    assert (opts["keyRanges"], opts["maxSplitBytes"], opts["failOnDataLoss"],
            opts["reconnectTimeout"]) == (4, 64 * 1024**2, False, 90_000)


def test_spark_lower_cased_keys_map_back() -> None:
    assert parse_options({"keyranges": "2"}, scope="read")["keyRanges"] == 2


def test_an_unknown_key_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'keyRange'; did you mean "
                                          r"'keyRanges'\?"):
        parse_options({"keyRange": "2"}, scope="read")


def test_a_bad_value_names_the_option_and_what_is_valid() -> None:
    with pytest.raises(ConfigError, match=r"invalid option 'maxSplitBytes': 'lots' .*expected "
                                          r"a size such as 64MiB"):
        parse_options({"maxSplitBytes": "lots"}, scope="read")


def test_environment_values_are_named_as_such_and_secrets_hidden(monkeypatch) -> None:
    monkeypatch.setenv("TIERSTREAM_RECONNECT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="environment variable TIERSTREAM_RECONNECT_TIMEOUT"):
        parse_options({}, scope="client")
    monkeypatch.delenv("TIERSTREAM_RECONNECT_TIMEOUT")
    option = OPTIONS["authToken"]
    assert option.secret
    assert parse_options({"authToken": "s3cret"}, scope="client")["authToken"] == "s3cret"


def test_options_of_another_scope_are_unknown_here() -> None:
    with pytest.raises(ConfigError, match="unknown option 'bookies'"):
        parse_options({"bookies": "3"}, scope="read")


def test_cli_help_shows_defaults_as_a_user_writes_them() -> None:
    assert OPTIONS["deletionLag"].help().endswith("(default 10m)")
    assert OPTIONS["maxSegmentBytes"].help().endswith("(default 256MiB)")
    assert OPTIONS["maxPartitionsPerTopic"].help().endswith("(default 1024)")
    assert "default" not in OPTIONS["authToken"].help()

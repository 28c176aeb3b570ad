import pytest

from tierstream.errors import ConfigError
from tierstream.model.names import TopicName

HOSTILE = [
    "..", "a/../b", "a/b/..", "a/./b", "a/b", "a/b/c/d", "/a/b", "a/b/", "a\\b\\c", "a/b\\c/d",
    "a/b/c\0", "", "a//b", "a/b/" + "x" * 300, "а/b/c",  # Cyrillic 'а'
    "a/b/ｃ",  # full-width c
    "a/b/-c", "a/b/.c", "a/b/c d",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_topic_names_are_rejected_with_the_name(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        TopicName.parse(name)
    assert "invalid topic name" in str(info.value)


def test_valid_names_round_trip() -> None:
    for name in ["acme/web/clicks", "t1/ns_2/topic.v-3", "A/" + "b" * 128 + "/c"]:
        assert str(TopicName.parse(name)) == name


def test_non_string_name_is_rejected() -> None:
    with pytest.raises(ConfigError, match="must be a string"):
        TopicName.parse(42)

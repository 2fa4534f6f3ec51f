import pytest

from pyini import DuplicateSectionError, ParseError, parse

SAMPLE = """\
# a comment
[metadata]
name = pyini
version: 0.3.1

[options]
packages =
    pyini
    pyini.ext
zip_safe = no
workers = 4
"""


def test_sections_in_order():
    assert parse(SAMPLE).sections() == ["metadata", "options"]


def test_equals_and_colon_separators():
    config = parse(SAMPLE)
    assert config.get("metadata", "name") == "pyini"
    assert config.get("metadata", "version") == "0.3.1"


def test_keys_are_case_insensitive():
    config = parse("[s]\nName = x\n")
    assert config.get("s", "NAME") == "x"


def test_missing_key_gives_the_default():
    assert parse(SAMPLE).get("metadata", "author", "nobody") == "nobody"


def test_continuation_lines_join_with_newlines():
    assert parse(SAMPLE).get("options", "packages") == "\npyini\npyini.ext"


def test_getlist_splits_lines_and_commas():
    config = parse("[s]\nitems = a, b\n    c\n")
    assert config.getlist("s", "items") == ["a", "b", "c"]


def test_getint_and_getboolean():
    config = parse(SAMPLE)
    assert config.getint("options", "workers") == 4
    assert config.getboolean("options", "zip_safe") is False


def test_getboolean_refuses_other_words():
    with pytest.raises(ValueError):
        parse("[s]\nflag = maybe\n").getboolean("s", "flag")


def test_full_line_comments_are_skipped():
    config = parse("[s]\n; one\n# two\nkey = value\n")
    assert config.items("s") == {"key": "value"}


def test_key_before_section_is_an_error():
    with pytest.raises(ParseError) as info:
        parse("key = value\n")
    assert info.value.lineno == 1


def test_duplicate_section_is_an_error():
    with pytest.raises(DuplicateSectionError):
        parse("[a]\n[a]\n")


def test_unclosed_header_is_an_error():
    with pytest.raises(ParseError):
        parse("[a\n")

import pytest

from semverlite import InvalidVersion, Version, max_satisfying


def test_parse_release():
    v = Version.parse("1.4.2")
    assert (v.major, v.minor, v.patch) == (1, 4, 2)
    assert not v.is_prerelease


def test_parse_prerelease_and_build():
    v = Version.parse("2.0.0-rc.1+build.7")
    assert v.prerelease == ("rc", "1")
    assert v.build == ("build", "7")
    assert str(v) == "2.0.0-rc.1+build.7"


@pytest.mark.parametrize("text", ["1.2", "01.2.3", "1.2.3-", "1.2.3+", "v1.2.3", "1.2.3-01"])
def test_invalid_versions_are_refused(text):
    with pytest.raises(InvalidVersion):
        Version.parse(text)


def test_release_numbers_compare_numerically():
    assert Version.parse("1.10.0") > Version.parse("1.9.0")
    assert Version.parse("2.0.0") > Version.parse("1.99.99")


def test_build_metadata_is_ignored():
    assert Version.parse("1.0.0+a") == Version.parse("1.0.0+b")


def test_prerelease_identifiers_compare_one_by_one():
    assert Version.parse("1.0.0-alpha.1") < Version.parse("1.0.0-alpha.beta")
    assert Version.parse("1.0.0-beta.2") < Version.parse("1.0.0-beta.11")


def test_bump():
    v = Version.parse("1.4.2")
    assert str(v.bump("major")) == "2.0.0"
    assert str(v.bump("minor")) == "1.5.0"
    assert str(v.bump("patch")) == "1.4.3"


def test_bump_patch_of_a_prerelease_releases_it():
    assert str(Version.parse("1.4.2-rc.1").bump("patch")) == "1.4.2"


def test_versions_hash_like_they_compare():
    assert len({Version.parse("1.0.0+x"), Version.parse("1.0.0")}) == 1


def test_max_satisfying_skips_prereleases_by_default():
    assert max_satisfying(["1.0.0", "1.2.0", "2.0.0-rc.1"], "1.0.0") == "1.2.0"

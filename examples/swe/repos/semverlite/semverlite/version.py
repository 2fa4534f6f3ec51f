"""A semantic version and its precedence (semver.org, section 11).

Precedence compares major, minor and patch numerically; a version with a pre-release has lower
precedence than the same version without one; pre-release identifiers compare one by one,
numeric ones numerically and below alphanumeric ones, and a longer list wins a tie. Build
metadata is ignored.
"""

import functools
import re

_PATTERN = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class InvalidVersion(ValueError):
    pass


def _identifier_key(identifier):
    # numeric identifiers sort before alphanumeric ones
    if identifier.isdigit():
        return (0, int(identifier), "")
    return (1, 0, identifier)


@functools.total_ordering
class Version:
    def __init__(self, major, minor, patch, prerelease=(), build=()):
        self.major, self.minor, self.patch = major, minor, patch
        self.prerelease = tuple(prerelease)
        self.build = tuple(build)

    @classmethod
    def parse(cls, text):
        match = _PATTERN.match(text.strip())
        if not match:
            raise InvalidVersion(f"not a semantic version: {text!r}")
        major, minor, patch, pre, build = match.groups()
        return cls(
            int(major),
            int(minor),
            int(patch),
            pre.split(".") if pre else (),
            build.split(".") if build else (),
        )

    def _key(self):
        release = (self.major, self.minor, self.patch)
        if not self.prerelease:
            return (release, 1, ())
        return (release, 0, tuple(_identifier_key(i) for i in self.prerelease))

    def __eq__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self):
        return f"Version.parse({str(self)!r})"

    @property
    def is_prerelease(self):
        return bool(self.prerelease)

    def bump(self, part):
        if part == "major":
            return Version(self.major + 1, 0, 0)
        if part == "minor":
            return Version(self.major, self.minor + 1, 0)
        if part == "patch":
            if self.prerelease:  # 1.2.3-rc.1 bumps to its release
                return Version(self.major, self.minor, self.patch)
            return Version(self.major, self.minor, self.patch + 1)
        raise ValueError(f"part must be major, minor or patch, got {part!r}")


def max_satisfying(versions, minimum, include_prereleases=False):
    """The highest of `versions` (strings) at or above `minimum`, or None."""
    floor = Version.parse(minimum)
    candidates = [Version.parse(v) for v in versions]
    candidates = [
        v for v in candidates if v >= floor and (include_prereleases or not v.is_prerelease)
    ]
    return str(max(candidates)) if candidates else None

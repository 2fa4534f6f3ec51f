"""Parsing INI text into a `Config`.

Rules: `[section]` headers; `key = value` or `key: value` pairs; lines starting with `#` or
`;` are comments, and so is the rest of a line after ` ;` or ` #` (a comment marker preceded
by whitespace); a line indented deeper than its key continues the previous value (joined with
a newline); keys are case-insensitive.
"""

from pyini.errors import DuplicateSectionError, ParseError

COMMENT_PREFIXES = ("#", ";")
TRUE = {"1", "yes", "true", "on"}
FALSE = {"0", "no", "false", "off"}


def _strip_inline_comment(value):
    for marker in COMMENT_PREFIXES:
        cut = value.find(" " + marker)
        if cut != -1:
            value = value[:cut]
    return value.rstrip()


class Config:
    def __init__(self):
        self._sections = {}

    def sections(self):
        return list(self._sections)

    def has_section(self, name):
        return name in self._sections

    def items(self, section):
        return dict(self._sections[section])

    def get(self, section, key, default=None):
        return self._sections.get(section, {}).get(key.lower(), default)

    def getint(self, section, key, default=None):
        value = self.get(section, key)
        return default if value is None else int(value)

    def getboolean(self, section, key, default=None):
        value = self.get(section, key)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in TRUE:
            return True
        if lowered in FALSE:
            return False
        raise ValueError(f"not a boolean: {value!r}")

    def getlist(self, section, key, default=None):
        value = self.get(section, key)
        if value is None:
            return default
        return [item.strip() for item in value.replace(",", "\n").splitlines() if item.strip()]


def parse(text):
    config = Config()
    section = None
    key = None
    key_indent = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith(COMMENT_PREFIXES):
            continue
        indent = len(raw) - len(raw.lstrip())
        if key is not None and indent > key_indent:
            previous = config._sections[section][key]
            config._sections[section][key] = previous + "\n" + _strip_inline_comment(stripped)
            continue
        if stripped.startswith("["):
            if not stripped.endswith("]"):
                raise ParseError(lineno, f"unclosed section header {stripped!r}")
            section = stripped[1:-1].strip()
            if section in config._sections:
                raise DuplicateSectionError(lineno, f"section {section!r} already defined")
            config._sections[section] = {}
            key = None
            continue
        if section is None:
            raise ParseError(lineno, "a key before any section")
        found = [(stripped.find(sep), sep) for sep in ("=", ":") if sep in stripped]
        if not found:
            raise ParseError(lineno, f"no '=' or ':' in {stripped!r}")
        _, separator = min(found)  # the first one on the line: "url: http://x?a=b"
        name, _, value = stripped.partition(separator)
        key = name.strip().lower()
        if not key:
            raise ParseError(lineno, "an empty key")
        key_indent = indent
        config._sections[section][key] = _strip_inline_comment(value.strip())
    return config

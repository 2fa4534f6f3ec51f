class ParseError(ValueError):
    """A line the parser cannot read; carries its line number."""

    def __init__(self, lineno, message):
        super().__init__(f"line {lineno}: {message}")
        self.lineno = lineno


class DuplicateSectionError(ParseError):
    pass

"""A small INI-file parser."""

from pyini.errors import DuplicateSectionError, ParseError
from pyini.parser import Config, parse

__all__ = ["Config", "DuplicateSectionError", "ParseError", "parse"]
__version__ = "0.3.1"

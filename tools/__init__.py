"""Development tools, each run as ``python tools/<tool>.py`` (docs/testing.md). A package so that the tests
import what they check of them (``from tools import mutation``); no runtime module imports it."""

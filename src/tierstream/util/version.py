"""tierstream's version, in one place below every layer: the package (``tierstream.__version__``),
the CLI and the broker (what it tells Pulsar clients it is) read it here. Keep it equal to
``pyproject.toml``'s (``tests/test_public_api.py`` checks)."""

VERSION = "0.1.0"

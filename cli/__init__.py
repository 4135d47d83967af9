"""Every command line of prefix-console: `python -m cli COMMAND ...` (see cli/__main__.py)."""

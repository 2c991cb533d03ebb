"""Benchmarks, one module per ``workbench bench NAME`` (see ``workbench.apps.cli``)."""

"""Applications: the `workbench` command (cli), compare and its training loop, the strategy
registry, the benchmarks. The top layer: nothing in the package imports it."""

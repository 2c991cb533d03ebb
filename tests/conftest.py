"""Test session set-up: what every launched rank would otherwise import again.

The ranks a test launches are forked from this process (a pytest worker). The first optimizer a
rank builds imports ``torch._dynamo`` (about a second of CPU per rank), and the first DDP or FSDP
PyTorch's parallel modules; :func:`workbench.apps.train.preload` does it once here, so every rank
forked afterwards inherits it, as the lessons do in their first cell.
"""
from workbench.apps.train import preload

preload()

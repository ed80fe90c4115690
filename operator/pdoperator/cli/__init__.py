"""``kubectl-pd`` (the kubectl plugin): ``kubectl_pd`` (commands and arguments), ``view`` (status, drift and
requests reports: pure reports plus one reader each). The console script is ``pdoperator.cli:main``."""

from .kubectl_pd import main

__all__ = ["main"]

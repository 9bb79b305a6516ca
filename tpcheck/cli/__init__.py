"""Front ends: the ``tpcheck`` command line (``app``), its subcommands' modules (``gate``, ``sweep``,
``compare_results``, ``fault_matrix``, ``completion``) and argument types (``arg_types``)."""
from tpcheck.cli.app import main

__all__ = ["main"]

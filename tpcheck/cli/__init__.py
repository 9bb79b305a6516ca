"""Front ends: the ``tpcheck`` command line (``app``: ``main``), its subcommands' modules (``gate``, ``sweep``,
``compare_results``, ``fault_matrix``, ``completion``) and argument types (``arg_types``)."""

"""Subcommands of the ``eplb`` command (see eplb.cli for the registry)."""

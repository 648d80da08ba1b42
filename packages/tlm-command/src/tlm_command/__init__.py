"""The ``tlm`` command: one module per subcommand (``info``, ``accounting``, ``generate``, ``eval``,
``convert``, ``tokenizer``, ``train``, ``serve``), each a thin layer over the library packages."""

from tlm_command.main import main

__version__ = "0.2.0"

__all__ = ["__version__", "main"]

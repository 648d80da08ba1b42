"""``python -m tlm``: the ``tlm`` command (the package is tlm-cli's ``tlm_cli``)."""

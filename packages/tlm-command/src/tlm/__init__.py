"""``python -m tlm``: the ``tlm`` command (the package is tlm-command's ``tlm_command``)."""

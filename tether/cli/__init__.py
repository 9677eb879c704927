"""The ``tether`` command."""

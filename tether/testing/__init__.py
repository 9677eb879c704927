"""Tools for testing tether (and jobs under it) on one machine."""

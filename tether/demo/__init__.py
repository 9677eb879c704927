"""``tether demo``: a real multi-rank CPU job under the recorder."""

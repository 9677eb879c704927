"""What the files of a dump event are, as code: torch-free, imported by their writers (the
ranks, the launcher) and their readers (``tether analyze``, ``tether show``) alike."""

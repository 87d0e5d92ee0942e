"""``polis bench``: measured figures, reported as ratios within one run."""

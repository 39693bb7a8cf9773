"""The bottom layer: runs, verdicts and the pass/fail policy, errors, progress, project configuration."""

"""The bottom layer: runs, verdicts and the pass/fail policy, errors, progress, project configuration.

Every other layer may import it; it imports no other part of diffcheck.
"""

__version__ = "0.1.0"

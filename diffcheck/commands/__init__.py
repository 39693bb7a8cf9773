"""One module per CLI command; each defines a click object named like the command."""

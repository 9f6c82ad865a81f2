"""The `srv` command line."""

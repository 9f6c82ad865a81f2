"""Launch arguments: the flag table, the parser built from it, config files and docs."""

"""Built-in plugins, one package per backend family, each loaded through its entry point."""

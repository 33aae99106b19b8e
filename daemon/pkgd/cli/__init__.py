"""Command line: `main()` dispatches to lazily imported subcommands."""

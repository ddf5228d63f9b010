"""The `tandem` command."""

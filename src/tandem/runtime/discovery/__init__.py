"""Discovery backends (DESIGN.md §1): memory, file, etcd; chosen by `make_discovery`."""

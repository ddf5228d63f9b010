"""The catalog: small persistent records kept where discovery is (memory, file, etcd)."""

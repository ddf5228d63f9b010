"""Content-addressed blobs kept where the cluster's discovery is: memory, file, etcd."""

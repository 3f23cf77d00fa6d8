"""Storage: local reads, fsspec roots, the lean HTTP/1.1 client, S3 signing, caches."""

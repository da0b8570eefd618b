"""The write side: a source walked (`sources/`: a folder, a list file, a table, a bucket, videos),
surveyed (`probe`), cut into shards (`plan`), each image encoded (`encode`) and each shard written by
a worker (`worker`, driven by `pack`) into a local folder (`folder_output`) or a bucket
(`bucket_output`), both behind one `Output` (`output`). Never imports the read side."""

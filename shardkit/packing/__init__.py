"""The write side: a source (folder, list file) walked (`discover`), surveyed (`probe`), cut into
shards (`plan`), each image encoded (`encode`) and each shard written by a worker (`pack`) into an
output folder (`output`) or a bucket (`publish`). Never imports the read side."""

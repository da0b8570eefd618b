"""Object storage (s3://, gs://, https://, any fsspec URL): the one seam remote reads and writes go
through. `urls` tells a URL from a path, `location` opens an output either way, `store` is a remote
folder with retries, `http` the direct download path, `cache` whole shards on local disk, `remote`
a remote output as readers see it, `download` the images of a URL table (over `webget`, one try).
Imports only `core`."""

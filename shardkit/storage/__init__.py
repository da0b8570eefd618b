"""Object storage (s3://, gs://, https://, any fsspec URL): the one seam remote reads and writes go
through. `urls` tells a URL from a path, `location` opens an output either way, `store` is a remote
folder, `http` its direct read path, `cache` whole shards on local disk, `remote` a remote output as
readers see it, `download` the images of a URL table (over `webget`, one try). `client` is the
process's one HTTP client, `retry` the one retry policy every remote request goes through.
Imports only `core`."""

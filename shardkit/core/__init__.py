"""The domain every side shares: errors, safe file I/O, config, image headers, the machine's codecs
and compiled kernels, the on-disk manifest and a packed clip's contract. Imports nothing else of
shardkit; what runs a command's processes is `shardkit.runtime`."""

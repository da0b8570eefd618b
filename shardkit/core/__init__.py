"""What every side shares: errors, safe file I/O, config, image headers, the machine's codecs and
compiled kernels, stop signals, worker processes and pools, Ray, and the on-disk manifest. Imports
nothing else of shardkit."""

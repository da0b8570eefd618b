"""shardkit: pack image folders into fast training shards (WebDataset, LMDB, HDF5)."""

__version__ = "0.1.0"

"""The read side, what a training job imports: `open_shards()` and its dataset (`dataset`), the
rank and worker split (`split`), record decoding (`decode`), the batch loader (`loader`) and where
its time goes (`stats`), remote shards through the cache (`cached`) and the torch glue
(`torch_data`). Never imports the write side.

    from shardkit.readers import open_shards
"""

from .dataset import ShardDataset, open_shards
from .samples import Sample
from .stats import LoaderStats

__all__ = ["LoaderStats", "Sample", "ShardDataset", "open_shards"]

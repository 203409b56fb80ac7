"""The data path: datasets and their sources, decoding, augmentation, the loader workers and how
they hand batches over, DALI, shards and their staging to a node-local folder."""

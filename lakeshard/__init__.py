"""The shared core of lakeshard: what both the jobs (``jobs/``) and the training side
(``loaders/``) import. Errors (:mod:`lakeshard.errors`), URIs and filesystems
(:mod:`lakeshard.storage`), configuration (:mod:`lakeshard.settings`) and the dataset format
(:mod:`lakeshard.format`). Nothing here imports Spark, Dask or torch.
"""

"""The exporter: a checkpoint -> a Triton model repository (repository.py: SavedModels,
saved_models.py; table files, table_files.py) or a delta against an earlier export (deltas.py),
written in deployment/repository_format.py's format. Reads checkpoints (storage, nn)."""

"""The server: a model repository (deployment/repository_format.py) served over HTTP and gRPC
(native.py, metrics.py) by a backend (monolithic.py: the monolithic SavedModel; live.py: the
tables form, updated while it serves, its tables in memory or through tiers/). Imports
nothing of training (no nn, parallel_embedding, dataloading, storage.checkpoint, exporter)."""

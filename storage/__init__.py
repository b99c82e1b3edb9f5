"""On-disk formats and caches below the packages that write into them: `checkpoint` (world-size-free
checkpoints: tensors under logical names, written as pieces by every rank), `row_cache` (which rows of
a table a cache holds and which make room: training's disk tier and serving's lookup tiers)."""

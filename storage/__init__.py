"""On-disk formats and caches below the packages that write into them: `checkpoint` (world-size-free
checkpoints: tensors under logical names, written as pieces by every rank)."""

"""What a launcher (horovodrun, mpirun, srun with PMI) tells the process it starts, read from the
environment without TensorFlow or Horovod: whether it runs as a rank, and how many ranks there are."""
import os
from typing import Optional

# (rank, world size) variables of horovodrun (Gloo), Open MPI and PMI (MPICH, Intel MPI, srun)
RANK_VARIABLES = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("PMI_RANK", "PMI_SIZE"))


def launched() -> bool:
    """True inside a process started by horovodrun (Gloo) or an MPI launcher."""
    return any(rank in os.environ for rank, _ in RANK_VARIABLES)


def world_size() -> Optional[int]:
    """The number of ranks: 1 where no launcher started this process, the launcher's count where
    it names one, None where it names none (Horovod's own count decides)."""
    for rank, size in RANK_VARIABLES:
        if rank in os.environ:
            value = os.environ.get(size, "")
            return int(value) if value.isdigit() and int(value) > 0 else None
    return 1

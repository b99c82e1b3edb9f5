"""File-system steps shared by the writers of checkpoints and model repositories."""
import os
import shutil


def move_into_place(tmp: str, final: str, old: str):
    """Renames the complete directory `tmp` to `final`. An existing `final` is first renamed to
    `old` and removed only once `tmp` is in its place, so one of the two is always whole."""
    if not os.path.exists(final):
        os.rename(tmp, final)
        return
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old)

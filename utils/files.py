"""File-system steps shared by the writers of checkpoints, model repositories and deltas."""
import errno
import json
import mmap
import os
import shutil
import zlib


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


def write_json(path: str, value) -> None:
    """Writes `value` as JSON to `path` through a temporary file renamed over it (synced): readers
    see the old file or the whole new one."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def no_space(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from: TensorFlow's and shutil's wrap the OSError's
    message) is a full device."""
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def tree_bytes(path: str) -> int:
    """The bytes of the files under directory `path`."""
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(path) for name in names)


def read_json(path: str, what: str, error: type):
    """The JSON value in `path`; raises `error` with one line if the file is missing ("DIR: not
    WHAT (no FILE)") or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{os.path.dirname(path) or '.'}: not {what} (no {os.path.basename(path)})")
    except (OSError, ValueError) as e:
        raise error(f"{path}: unreadable ({e})")


class Checksummed:
    """A binary file to write to that keeps the CRC-32 of what was written (`crc`): a file's
    checksum without reading it back."""

    def __init__(self, file):
        self.file, self.crc = file, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.file.write(data)


CRC_WINDOW = 64 << 20   # bytes of a file mapped at a time by file_crc32 (a multiple of mmap's granularity)


def file_crc32(path: str) -> int:
    """zlib's CRC-32 of the file at `path`, read memory-mapped a window of CRC_WINDOW bytes at a time
    (no copy out of the page cache, and no more than a window of it mapped)."""
    crc = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for start in range(0, size, CRC_WINDOW):
            with mmap.mmap(f.fileno(), min(CRC_WINDOW, size - start), access=mmap.ACCESS_READ, offset=start) as m, \
                    memoryview(m) as view:
                crc = zlib.crc32(view, crc)
    return crc

"""How the toolkit tells the user. The one exception type for mistakes a user can
fix (bad recipe, missing file, wrong world size, corrupt checkpoint): the CLI prints
its lines and exits 2; anything else is a bug in the toolkit and keeps its traceback.
Plus how a failed write (full disk, file-size limit, read-only) is told in a few
words, and `warn_once`, the one way a warning is printed once per launch however
many ranks and processes meet it."""
import errno
import hashlib
import os
import re
import sys


class UserError(Exception):
    """A mistake the user can fix; each line of `lines` names what and where."""

    def __init__(self, *lines: str):
        self.lines = [str(line) for line in lines]
        super().__init__("\n".join(self.lines))


_WARNED_ENV = "TOOLKIT_WARNED"


def warn_once(line: str) -> None:
    """Print `warning: line` to stderr once per launch: once per process, on rank 0 only, and not again in
    ranks that `toolkit run --nproc` starts after the launcher printed it."""
    # NOTE: the printed lines' digests go into the environment, which the launcher's ranks inherit.
    digest = hashlib.sha256(line.encode()).hexdigest()[:12]
    warned = os.environ.get(_WARNED_ENV, "").split()
    if digest in warned or os.environ.get("RANK", "0") != "0":
        return
    os.environ[_WARNED_ENV] = " ".join([*warned, digest])
    print(f"warning: {line}", file=sys.stderr, flush=True)


# What a failed write reports: full disk, quota, file-size limit, read-only or forbidden, a file in a folder's place.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                errno.EEXIST, errno.EISDIR, errno.EIO}


def os_errno(exc: BaseException) -> int | None:
    """The errno of an OSError, or of a library error that quotes one (safetensors: "... (os error 27)")."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def describe_os_error(exc: BaseException) -> str:
    """Why an I/O call failed, in a few words: `No space left on device (ENOSPC)` for an OSError."""
    code = os_errno(exc)
    if code in errno.errorcode:
        return f"{getattr(exc, 'strerror', None) or os.strerror(code)} ({errno.errorcode[code]})"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def failed_write(exc: BaseException, path) -> str | None:
    """`FILE: cannot write: why` for a write that failed (full disk, file-size limit, read-only, ...): the
    error's own file name where it has one, else `path`; None when `exc` is not a failed write."""
    if os_errno(exc) not in WRITE_ERRNOS:
        return None
    return f"{getattr(exc, 'filename', None) or path}: cannot write: {describe_os_error(exc)}"


def write_failure(exc: BaseException, path) -> UserError | None:
    """One line for a write of the run that failed, with the way out; None when `exc` is not a failed write
    (a bug keeps its traceback)."""
    line = failed_write(exc, path)
    return None if line is None else UserError(f"{line}; free space or fix the permissions, then rerun the same "
                                               "command to resume")

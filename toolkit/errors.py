"""The one exception type for mistakes a user can fix (bad recipe, missing file,
wrong world size, corrupt checkpoint). The CLI prints its lines and exits 2;
anything else is a bug in the toolkit and keeps its traceback."""


class UserError(Exception):
    """A mistake the user can fix; each line of `lines` names what and where."""

    def __init__(self, *lines: str):
        self.lines = [str(line) for line in lines]
        super().__init__("\n".join(self.lines))


def describe_os_error(exc: BaseException) -> str:
    """Why an I/O call failed, in a few words: `No space left on device (ENOSPC)` for an OSError."""
    import errno
    import os
    import re

    code = exc.errno if isinstance(exc, OSError) else None
    found = re.search(r"\(os error (\d+)\)", str(exc))  # safetensors: "I/O error: File too large (os error 27)"
    code = code if code is not None else int(found.group(1)) if found else None
    if code in errno.errorcode:
        return f"{getattr(exc, 'strerror', None) or os.strerror(code)} ({errno.errorcode[code]})"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The one exception type for mistakes a user can fix (bad recipe, missing file,
wrong world size, corrupt checkpoint). The CLI prints its lines and exits 2;
anything else is a bug in the toolkit and keeps its traceback."""


class UserError(Exception):
    """A mistake the user can fix; each line of `lines` names what and where."""

    def __init__(self, *lines: str):
        self.lines = [str(line) for line in lines]
        super().__init__("\n".join(self.lines))

"""The project's own error: one clear line for the user, exit status 2."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # a measurement or llama.cpp step failed after the input was accepted
EXIT_USAGE = 2  # bad input or a refused resource: nothing was run or written
EXIT_BUSY = 3  # --strict, and other processes loaded the CPU (runner.NoisyMachine)
EXIT_DISK_FULL = 4  # the disk filled up mid-way: what was written is kept, resume when freed
EXIT_INTERRUPTED = 130


class HarnessError(Exception):
    """A user-facing error: the message names the file, the key and the fix."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None,
                 line: int | None = None, fix: str | None = None) -> None:
        self.message = message
        self.source = source
        self.key = key
        self.line = line
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        """Return the single line shown to the user."""
        where = ""
        if self.source:
            where = str(self.source)
            if self.line is not None:
                where += f":{self.line}"
            where += ": "
        key = f"{self.key}: " if self.key else ""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{where}{key}{self.message}{fix}".replace("\n", " ")


class DiskFull(HarnessError):
    """The disk filled up (or a quota ran out) while writing."""

    exit_code = EXIT_DISK_FULL


def is_disk_full(exc: BaseException) -> bool:
    """DiskFull, or an OSError that says no space is left (ENOSPC) or a quota is spent
    (EDQUOT)."""
    import errno

    return isinstance(exc, DiskFull) or (isinstance(exc, OSError)
                                         and exc.errno in (errno.ENOSPC, errno.EDQUOT))


class MeasurementError(HarnessError):
    """llama.cpp failed while loading or running a model that passed validation."""

    exit_code = EXIT_FAILURE
    step = "run"  # load, prefill, decode, ... : set where it is raised


class Interrupted(Exception):
    """The user asked to stop (Ctrl-C); raised where work can stop cleanly."""

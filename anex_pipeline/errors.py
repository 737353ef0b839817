"""The errors a user sees, and the types a failed row's error can have.

Every exception whose message reaches a person (on the terminal, in a Batch API answer, in a
failed row or a step's failure) derives from :class:`AnexError`: it carries one line saying what
went wrong, where, and what to change, and the exit status the command ends with. The command
line and the Batch API each handle the base class in one place. The failures that one layer
raises and a higher one catches (a job asked to stop, an engine that did not load, vLLM's engine
process gone) live here too, so that neither layer imports the other for them.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ExitCode(IntEnum):
    """How ``anex-pipeline`` ends."""

    OK = 0  # the job completed with at least one row answered (other rows may have failed)
    STOPPED = 1  # the job failed, stopped early, or no row succeeded
    REJECTED = 2  # refused before anything ran (a submit-time problem, a usage mistake)


class AnexError(Exception):
    """A failure the user can act on. ``message`` is the one line shown for it (some subclasses
    render more lines: see :meth:`render`); ``exit_code`` is the status the command ends with."""

    exit_code: ExitCode = ExitCode.STOPPED

    def __init__(self, message: str, *args: object):
        super().__init__(message, *args)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def render(self) -> str:
        """What the command prints for this error."""
        return f"error: {self.message}"


class RejectedError(AnexError):
    """A failure of the kind that refuses a job before anything runs (exit status 2)."""

    exit_code = ExitCode.REJECTED


class JobStopped(AnexError):
    """The job was asked to stop (cancelled or out of time); finished rows are kept."""


class EngineLoadFailed(AnexError):
    """The engine could not be loaded (e.g. the model is missing, its configuration is not one
    vLLM accepts, or memory ran out): loading it again at once with the same settings would fail
    the same way, so for a minute (the loader's ``FAILED_LOAD_KEPT_S``) the same settings get the
    same failure."""


class EngineProcessDied(AnexError, RuntimeError):
    """vLLM's engine process ended during a call; the engine cannot be used any more."""


class RowErrorType(StrEnum):
    """The ``error.type`` of a failed row, as written into result and error files. The values are
    the strings OpenAI's batch output uses (plus our own for media and the Batch API), so readers
    that compare strings keep working."""

    INVALID_REQUEST = "invalid_request_error"  # the row cannot be run as it is (a 400)
    ENGINE = "engine_error"  # the engine failed on the row
    MEDIA_FETCH = "media_fetch_error"  # media the row references could not be downloaded
    BATCH = "batch_error"  # the batch ended (cancelled, expired, failed) before the row ran
    PENDING = "pending"  # the row has not run yet (a read of a running job's rows that marks them)
    # A Parquet result's error_type column also flags rows that succeeded with a caveat:
    LENGTH = "length"  # the answer stopped at its token cap
    FORMAT = "format_error"  # the answer is not the JSON its response_format asked for

"""Running a job's steps in this process, one Dagster run each, in the order the plan gives.

Two callers drive a job themselves while they hold its lease, and both go through :func:`drive`:
the command's runner (``anex-pipeline run``, ``backfill`` and the Batch API), which reads where
the job stands from its work folder (:class:`FolderProgress`), and the success hook of a small
job's submit run, which reads it from the instance. The ``job_driver`` sensor asks the same plan
(:func:`~anex_pipeline.orchestration.plan.next_steps`) and turns its steps into run requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from anex_pipeline.orchestration.names import ESTIMATE_JOB, FINISH_JOB, SHARD_JOB
from anex_pipeline.orchestration.partitions import split_shard_key
from anex_pipeline.orchestration.plan import JobState, ShardFailure, Step, next_steps
from anex_pipeline.workdir.manifest import JobDir, unfinished_shards

# Storage ids for a state read from the work folder, where events have no numbers of their own:
# they only have to keep the order the plan compares (submitted < estimated < a shard's end < finished).
_SUBMITTED, _ESTIMATED, _SHARD_ENDED, _FINISHED = 1, 2, 3, 4


def drive(read: Callable[[], JobState], run: Callable[[Step], bool], rounds: int) -> bool:
    """Runs the steps the plan asks for, reading the state again after each round, until it asks
    for none (True) or ``run`` returns False for one (False: the caller ends the drive there).
    ``rounds`` bounds the rounds, so a state that never moves cannot keep it going (False)."""
    for _ in range(rounds):
        steps = next_steps(read())
        if not steps:
            return True
        for step in steps:
            if not run(step):
                return False
    return False


@dataclass
class FolderProgress:
    """Where a job that this process drives stands, from its work folder and from what this drive
    did: the estimate is made once its file exists; the shards with rows left when it was made (or
    those asked for) are to run; each is done once its run ends, or given up when its run failed;
    a stop sends the job to its finish at once."""

    job: JobDir
    asked: Sequence[int] | None = None  # the shards to run; None: every shard with rows left
    done: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)  # shard -> why its run failed
    stopped: bool = False
    finished: bool = False
    _chosen: list[int] | None = None

    def state(self) -> JobState:
        shard_count = len(self.job.manifest().shards)
        finished = _FINISHED if self.finished else 0
        if not self.job.estimate_path.exists():
            return JobState(self.job.job_id, _SUBMITTED, shard_count, finished=finished, stopped=self.stopped)
        if self._chosen is None:  # after the estimate, which may answer rows of its own
            self._chosen = unfinished_shards(self.job) if self.asked is None else list(self.asked)
        chosen = set(self._chosen) - self.done
        return JobState(
            self.job.job_id,
            _SUBMITTED,
            shard_count,
            _ESTIMATED,
            shards={s: _SHARD_ENDED for s in range(shard_count) if s not in chosen},
            finished=finished,
            failures={s: ShardFailure(_SHARD_ENDED, reason) for s, reason in self.failed.items()},
            stopped=self.stopped,
        )

    def ended(self, step: Step, failure: str | None) -> None:
        """Notes how one of the job's steps ended (``failure``: why it failed; None: it succeeded)."""
        if step.job_name == SHARD_JOB:
            shard = split_shard_key(step.partition_key)[1]
            if failure is None:
                self.done.add(shard)
            else:
                self.failed[shard] = failure
        elif step.job_name == FINISH_JOB and failure is None:
            self.finished = True
        elif step.job_name == ESTIMATE_JOB and failure is not None:
            self.stopped = True

"""What moves a job on next: one pure function over where the job stands.

A job's steps are the submit, the length estimate, one step per shard, and the finish (merge and
publish). Where a job stands is told by storage ids, the instance's numbering of its events
(larger is later): the latest materialization of each step, and the latest failed run of each
shard. :func:`next_steps` reads nothing else, so "why did my job not move on?" is answered here:

- the estimate comes after every submission (a resubmission makes a new one);
- every shard not materialized since the latest estimate runs, unless its latest run failed
  after that estimate (its retries spent): the job is then finished without it;
- the finish comes once no shard is left, and again after any shard's later run;
- a job whose driving process was asked to stop goes to its finish at once (the finish publishes
  what is done, and the report says why the job stopped).

The ``job_driver`` sensor builds a :class:`JobState` from the instance and turns each
:class:`Step` into a run request. A process that drives a job itself (the command, the Batch API,
a submit run that carries its small job on) runs the steps in-process through
:func:`~anex_pipeline.orchestration.in_process.drive`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from anex_pipeline.orchestration.names import ESTIMATE_JOB, FAILED_SHARDS_TAG, FINISH_JOB, SHARD_JOB
from anex_pipeline.orchestration.partitions import job_shard_key


@dataclass(frozen=True)
class ShardFailure:
    """The last failed run of a shard: when it failed (the storage id of its end, comparable with
    those of the materializations in :class:`JobState`) and why."""

    storage_id: int
    reason: str


@dataclass(frozen=True)
class JobState:
    """Storage ids of the latest materialization of each step of one job (0 = never), its shard
    count and its shards' latest failures."""

    job_id: str
    submitted: int
    shard_count: int
    estimated: int = 0
    shards: Mapping[int, int] = field(default_factory=dict)
    finished: int = 0
    failures: Mapping[int, ShardFailure] = field(default_factory=dict)
    stopped: bool = False  # a stop was asked of the process driving it: its finish comes next

    def pending_shards(self) -> list[int]:
        """Shards not materialized since the job's latest estimate."""
        return [s for s in range(self.shard_count) if self.shards.get(s, 0) < self.estimated]

    def given_up(self) -> dict[int, ShardFailure]:
        """Pending shards whose latest run failed after the estimate: the job finishes without them."""
        failures = self.failures
        return {
            s: failures[s] for s in self.pending_shards() if s in failures and failures[s].storage_id > self.estimated
        }


@dataclass(frozen=True)
class Step:
    """One run that moves a job on. ``run_key`` names the event it follows, so a step is asked for
    once per submission (and once more only after its input changed)."""

    job_name: str
    partition_key: str
    run_key: str
    tags: Mapping[str, str] = field(default_factory=dict)


def next_steps(state: JobState) -> list[Step]:
    """The runs that move the job on now; none when it is finished (or waits for nothing). A shard
    whose run failed for good is not asked for again: the job is merged and published without its
    rows (rerun the shard, e.g. from the partitions view, and the job is published again)."""
    job_id = state.job_id
    if state.stopped:
        ended = max([state.submitted, state.estimated, *state.shards.values()])
        ended = max([ended, *(f.storage_id for f in state.failures.values())])
        return [Step(FINISH_JOB, job_id, f"finish:{job_id}:{ended}")] if state.finished < ended else []
    if state.estimated < state.submitted:
        return [Step(ESTIMATE_JOB, job_id, f"estimate:{job_id}:{state.submitted}")]
    failed = state.given_up()
    waiting = [s for s in state.pending_shards() if s not in failed]
    if waiting:
        return [Step(SHARD_JOB, job_shard_key(job_id, s), f"shard:{job_id}:{s}:{state.estimated}") for s in waiting]
    last = max(
        (failed[s].storage_id if s in failed else state.shards[s] for s in range(state.shard_count)),
        default=state.estimated,
    )
    if state.finished < last:
        tags = {FAILED_SHARDS_TAG: ",".join(map(str, failed))} if failed else {}
        return [Step(FINISH_JOB, job_id, f"finish:{job_id}:{last}", tags)]
    return []

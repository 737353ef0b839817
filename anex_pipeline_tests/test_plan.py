"""What moves a job on next, from where it stands: plan.next_steps over JobState values, with no
Dagster instance (the sensor and the carry-on hook both run what it asks for)."""

from __future__ import annotations

from anex_pipeline.orchestration import names
from anex_pipeline.orchestration.assets import all_assets
from anex_pipeline.orchestration.in_process import drive
from anex_pipeline.orchestration.jobs import asset_jobs
from anex_pipeline.orchestration.plan import JobState, ShardFailure, Step, next_steps


def steps(state: JobState) -> list[tuple[str, str]]:
    return [(s.job_name, s.partition_key) for s in next_steps(state)]


def test_a_submitted_job_is_estimated_first_and_again_after_a_resubmission() -> None:
    assert next_steps(JobState("j", submitted=5, shard_count=2)) == [Step("estimate_job", "j", "estimate:j:5")]
    resubmitted = JobState("j", submitted=9, shard_count=2, estimated=6, shards={0: 7, 1: 8}, finished=8)
    assert steps(resubmitted) == [("estimate_job", "j")]


def test_every_shard_not_made_since_the_estimate_runs_keyed_by_that_estimate() -> None:
    state = JobState("j", submitted=5, shard_count=3, estimated=6, shards={0: 7, 2: 4})
    assert next_steps(state) == [Step("shard_job", "j|01", "shard:j:1:6"), Step("shard_job", "j|02", "shard:j:2:6")]


def test_the_finish_comes_after_the_last_shard_and_again_after_a_later_shard_run() -> None:
    done = JobState("j", submitted=5, shard_count=2, estimated=6, shards={0: 7, 1: 8})
    assert next_steps(done) == [Step("finish_job", "j", "finish:j:8")]
    assert next_steps(JobState(**{**done.__dict__, "finished": 9})) == []
    rerun = JobState(**{**done.__dict__, "shards": {0: 10, 1: 8}, "finished": 9})
    assert next_steps(rerun) == [Step("finish_job", "j", "finish:j:10")]


def test_a_shard_that_failed_after_the_estimate_is_given_up_and_named_on_the_finish() -> None:
    failure = ShardFailure(storage_id=9, reason="engine died")
    state = JobState("j", submitted=5, shard_count=2, estimated=6, shards={0: 7}, failures={1: failure})
    assert state.given_up() == {1: failure}
    assert next_steps(state) == [Step("finish_job", "j", "finish:j:9", {names.FAILED_SHARDS_TAG: "1"})]


def test_a_failure_from_before_the_latest_estimate_does_not_give_a_shard_up() -> None:
    old = ShardFailure(storage_id=3, reason="an earlier submission's run")
    state = JobState("j", submitted=5, shard_count=2, estimated=6, shards={0: 7}, failures={1: old})
    assert state.given_up() == {}
    assert steps(state) == [("shard_job", "j|01")]


def test_the_names_are_those_of_the_assets_and_jobs() -> None:
    keys = {key for asset in all_assets for key in asset.keys}
    wanted = [names.VALIDATED_INPUT, names.LENGTH_ESTIMATE, names.FETCHED_MEDIA]
    assert {*wanted, names.GENERATIONS, names.MERGED_RESULT, names.RESULT_FILE} <= keys
    jobs = [job.name for job in asset_jobs()]
    assert jobs == [names.SUBMIT_JOB, names.ESTIMATE_JOB, names.SHARD_JOB, names.FINISH_JOB]


def test_a_stopped_job_goes_to_its_finish_once() -> None:
    stopped = JobState("j", submitted=1, shard_count=3, estimated=2, shards={0: 3}, stopped=True)
    assert next_steps(stopped) == [Step("finish_job", "j", "finish:j:3")]
    assert next_steps(JobState(**{**stopped.__dict__, "finished": 4})) == []
    before_the_estimate = JobState("j", submitted=1, shard_count=3, stopped=True)
    assert steps(before_the_estimate) == [("finish_job", "j")]


def test_the_drive_runs_each_round_the_plan_asks_for_and_ends_on_a_refused_step() -> None:
    state = JobState("j", submitted=1, shard_count=2)
    ran: list[str] = []

    def run(step: Step) -> bool:
        nonlocal state
        ran.append(step.partition_key)
        if step.job_name == "estimate_job":
            state = JobState(**{**state.__dict__, "estimated": 2})
        elif step.job_name == "shard_job":
            shard = int(step.partition_key.split("|")[1])
            state = JobState(**{**state.__dict__, "shards": {**state.shards, shard: 3 + shard}})
        else:
            state = JobState(**{**state.__dict__, "finished": 9})
        return True

    assert drive(lambda: state, run, rounds=4)
    assert ran == ["j", "j|00", "j|01", "j"]
    ran.clear()
    state = JobState("k", submitted=1, shard_count=2)
    assert not drive(lambda: state, lambda step: ran.append(step.job_name) is not None, rounds=4)
    assert ran == ["estimate_job"], "a step refused ends the drive"
    assert not drive(lambda: state, lambda step: True, rounds=3), "a state that never moves ends with the rounds"

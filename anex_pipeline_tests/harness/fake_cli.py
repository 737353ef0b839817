"""``anex-pipeline`` with the fake engine behind it, for tests that must run the command in its own
process (and kill it). The fake answers slowly when ANEX_FAKE_ROW_DELAY_S is set, so that a test
can kill the process in the middle of a shard."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from anex_pipeline import cli
from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine


class SlowFakeEngine(FakeEngine):
    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        time.sleep(float(os.environ.get("ANEX_FAKE_ROW_DELAY_S", "0")) * len(requests))
        return super().run(requests)


SLOW_FAKE = "slow-fake"  # the engine kind of this fake
_slow: dict[str, SlowFakeEngine] = {}


def slow_fake_engine(model_name: str) -> SlowFakeEngine:
    """The process's slow fake engine of a model, as jobs of the kind SLOW_FAKE get it."""
    return _slow.setdefault(model_name, SlowFakeEngine(model_name))


register_engine(SLOW_FAKE, lambda config, manifest: slow_fake_engine(manifest.model_name))


if __name__ == "__main__":
    os.environ["ANEX_ENGINE"] = SLOW_FAKE  # the command's engine settings read it
    sys.exit(cli.main())

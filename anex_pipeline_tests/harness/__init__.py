"""What the tests share besides fixtures: fake servers and code locations, tiny models, job helpers.
Assertions in these modules are rewritten as in test modules, so a failing helper shows its values."""

import pytest

pytest.register_assert_rewrite("anex_pipeline_tests.harness")

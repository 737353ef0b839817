import pytest

# Assertions in the harness read as in test modules when they fail (set before any harness import).
pytest.register_assert_rewrite("anex_pipeline_tests.harness")

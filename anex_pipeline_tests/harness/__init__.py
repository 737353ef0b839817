"""What the tests share besides fixtures: fake servers and code locations, tiny models, job helpers."""

"""The in-process vLLM engine (:mod:`.engine`), the watchdog that turns the death of its engine
process into an error (:mod:`.watchdog`) and the environment of vLLM's CPU processes
(:mod:`.cpu_environment`)."""

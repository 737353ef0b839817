"""The engine that sends rows to OpenAI-compatible servers (:mod:`.engine`) and the replicas it
spreads them over (:mod:`.replicas`)."""

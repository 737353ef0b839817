"""Model runtimes behind one interface (:mod:`~anex_pipeline.engine.base`), loaded once per
process by :mod:`~anex_pipeline.engine.loader`: the in-process vLLM engine (:mod:`.vllm`) and the
client of OpenAI-compatible servers (:mod:`.http`)."""

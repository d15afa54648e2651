"""ignis.client: what talks to a GPU process from the caller's side.

`LLM` (sync, batch) and `AsyncLLM` (async streaming) over an EngineClient: `ProcessClient` / `AsyncEngineClient`
across a ZeroMQ socket (a child GPU process, or one running at an address), or `InprocClient` in the same process.
Text (detokenizing, stop strings) is done here, never in the GPU process. Nothing is imported eagerly.
"""

"""The OpenAI API surface: the request bodies (protocol), a body -> prompt ids + SamplingParams checked
against the engine (requests; structured output and tools: structured_requests, tools, tool_formats;
<think> blocks: reasoning), and the response bodies and SSE chunks (responses)."""

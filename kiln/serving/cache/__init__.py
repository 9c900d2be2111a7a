"""The server's response caches: exact-match (response_cache) and semantic (semantic_cache, its
guards in semantic_guards, the server's side in semantic_requests, the ONNX embedder in embedder)."""

"""The OpenAI-compatible HTTP surface: request schemas, response rendering, the error map."""

"""The OpenAI / SGLang surface: request schemas and bounds, response shaping, tool calls, structured output."""

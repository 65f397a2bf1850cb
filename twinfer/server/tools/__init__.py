"""Tool calls and reasoning in generated text: which family a chat template speaks (families.py),
how a request's tools are served (plan.py), and the streaming parsers (parsers.py, reasoning.py)
that turn output text into content, reasoning and OpenAI tool calls (events.py)."""

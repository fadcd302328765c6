"""One module per OpenAI route."""

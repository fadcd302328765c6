"""Parsing and validation of OpenAI request bodies into typed, normalised requests."""
